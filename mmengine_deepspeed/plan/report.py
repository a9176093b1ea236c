"""``plan``'s text: the model, the activations, one line per row, the recommendation."""
from __future__ import annotations

from typing import Optional

from .memory import MIB
from .planner import Plan, Row

WHY = ('"more than ZeRO-0 for": what adds most where a row\'s peak is above ZeRO-0\'s: states '
       '(parameters, fp32 master weights, optimizer states, gradient partitions), buffers '
       '(gradient buckets, gathered layers), activations, offload (moved to the same host '
       'memory), heap (freed memory glibc keeps), runtime (DeepSpeed\'s stage, measured); '
       '"MiB per sample": what one more sample per rank adds, which sets the max micro-batch.')


def _count(n: float) -> str:
    for unit, size in (('B', 1e9), ('M', 1e6), ('K', 1e3)):
        if n >= size:
            return f'{n / size:.2f}{unit}'
    return str(int(n))


def ds_config_lines(row: Row, precision: str) -> str:
    """The ds_config a user pastes for ``row``."""
    zero = [f'stage={row.stage}']
    if row.offload_optimizer != 'none':
        zero.append("offload_optimizer=dict(device='cpu')")
    if row.offload_param != 'none':
        zero.append("offload_param=dict(device='cpu')")
    parts = [f'zero_optimization=dict({", ".join(zero)})']
    if precision != 'fp32':
        parts.append(f'{precision}=dict(enabled=True)')
    return f'ds_config = dict({", ".join(parts)})'


def _advice(plan: Plan) -> str:
    best: Optional[Row] = plan.recommended
    if best is not None:
        return (f'recommended: ZeRO-{best.stage}'
                + (', optimizer offloaded to CPU' if best.offload_optimizer != 'none' else '')
                + (', parameters offloaded to CPU' if best.offload_param != 'none' else '')
                + f' (peak {best.peak_mib:.0f} of {plan.device_mib:.0f} MiB per rank; micro-batch'
                f' up to {best.max_micro_batch}):\n    {ds_config_lines(best, plan.precision)}')
    lowest = min(plan.rows, key=lambda row: row.peak_mib)
    smaller = max(plan.rows, key=lambda row: row.max_micro_batch)
    if smaller.max_micro_batch > 0:
        return (f'nothing fits at micro-batch {lowest.micro_batch}: ZeRO-{smaller.stage} '
                f'(offload optimizer={smaller.offload_optimizer}, param={smaller.offload_param}) '
                f'fits micro-batch {smaller.max_micro_batch}; raise accumulative_counts to keep '
                'the effective batch, or add ranks.')
    return (f'nothing fits: the lowest peak is {lowest.peak_mib:.0f} MiB per rank (ZeRO-'
            f'{lowest.stage}, offload optimizer={lowest.offload_optimizer}, '
            f'param={lowest.offload_param}) against {plan.device_mib:.0f}; add ranks or memory.')


def plan_text(plan: Plan) -> str:
    """What ``plan`` prints without ``--json``."""
    ranks = plan.nproc * plan.nnodes
    acts = plan.activations
    lines = [f'plan: {ranks} rank(s) ({plan.nproc} per node x {plan.nnodes} node(s)), '
             f'{plan.platform}, {plan.precision}; {plan.device_mib:.0f} MiB per rank, '
             f'{plan.host_mib:.0f} MiB host per node']
    if plan.layout is not None:
        per_rank, split = plan.layout['virtual_ranks_per_rank'], plan.layout['micro_batches']
        lines.append(
            f'layout: the {plan.layout["world_size"]}-rank run, {per_rank} virtual rank(s) per '
            f'rank one after another' + (
                f', each one\'s batch in {split} micro-batches ({plan.layout["why"]})'
                if split > 1 or plan.layout['why'] else '') +
            f': each rank holds one micro-batch ({plan.micro_batch}) at a time, so the rows '
            f'are those of {plan.micro_batch} per rank (the configured row: '
            f'{plan.layout["peak_mib"]:.0f} MiB), and each optimizer step takes '
            f'{per_rank * split} micro-steps')
    for engine in plan.engines:
        dtypes = ', '.join(f'{k} {_count(v)}' for k, v in engine.dtypes.items())
        lines.append(
            f'engine {engine.name!r}' + (f' (model.{engine.path})' if engine.path else '')
            + f': {_count(engine.params)} parameters ({_count(engine.trainable)} trained, '
            f'{_count(engine.frozen)} frozen; {dtypes}), largest layer '
            f'{_count(engine.largest_layer)}; {engine.optimizer or "no optimizer"} keeps '
            f'{engine.states} state(s) per trained element')
    how = ('traced on the meta device' if acts.method == 'traced' else
           f'measured with one real step of {acts.micro_batch} sample(s) on the CPU and '
           f'scaled, as {acts.note}')
    lines.append(f'activations: {acts.bytes_at(plan.micro_batch, acts.float_size) / MIB:.1f} '
                 f'MiB saved for backward at micro-batch {plan.micro_batch} ({how}; '
                 f'{acts.float_size}-byte floats)')
    if plan.platform == 'cpu':
        lines.append(f'fixed: {plan.fixed_mib:.0f} MiB (this process after imports, before the '
                     "config's model and data, where the training log's prediction starts; "
                     'each rank holds as much) plus the runtime; figures are peak RSS')
    lines += ['', '| ZeRO | offload optimizer | offload param | micro-batch | peak MiB/rank '
              '| more than ZeRO-0 for | MiB per sample | host MiB/node | construction MiB '
              '| fits | max micro-batch |',
              '|---|---|---|---|---|---|---|---|---|---|---|']
    lines += [f'| {r.stage} | {r.offload_optimizer} | {r.offload_param} | {r.micro_batch} | '
              f'{r.peak_mib:.0f} | {r.why or "-"} | {r.mib_per_sample:.1f} | {r.host_mib:.0f} | '
              f'{r.construct_mib:.0f} | {"yes" if r.fits else "no"} | {r.max_micro_batch} |'
              for r in plan.rows]
    lines += ['', WHY, _advice(plan)]
    lines += [f'note: {note}' for note in plan.notes]
    return '\n'.join(lines)
