"""``mmengine-deepspeed plan``: per-rank memory of a config under every ZeRO stage and offload.

From the config as ``train`` resolves it, without allocating the model's
weights and without a process group: the census (``census.py``), one traced
training step (``activations.py``) and DeepSpeed's layout (``memory.py``) give,
for each row (ZeRO 0-3 x offload), the predicted peak on one rank (what the
training log reports as ``peak_mem_mb``: the CUDA allocator's peak, or the
process's peak RSS on the CPU), the host memory per node that offload needs,
whether it fits, the largest micro-batch that fits, and the fastest row that
fits as ds_config lines.
"""
from __future__ import annotations

import contextlib
import copy
import gc
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from mmengine.config import Config
from torch import nn

from ..config.checks import offload_devices
from ..config.layout import Layout
from ..config.model_settings import fit_zero_sizes
from ..config.runner_keys import switch
from ..dist import cuda_available
from ..engine.spec import EngineSpecs
from ..process_memory import rss_mib
from .activations import Activations, one_batch, trace_activations
from .census import EngineCensus, census, construction_note, import_scope, meta_model
from .memory import (
    CPU_RUNTIME_MIB,
    MIB,
    Breakdown,
    MemoryLayout,
    activation_bytes,
    cpu_heap_kept,
    engine_bytes,
    fills_empty,
    transient_bytes,
)

# (stage, offload optimizer, offload parameters), fastest first: the recommendation is the
# first that fits (a lower stage communicates less; offload moves every step over PCIe).
ROWS = [(0, False, False), (1, False, False), (2, False, False), (3, False, False),
        (1, True, False), (2, True, False), (3, True, False), (3, True, True)]
# zero.Init's fixed cost beyond the partitions (measured: scale.py --cold, RESULTS.md).
ZERO_INIT_FIXED_MIB = 60.0
MAX_MICRO_BATCH = 1 << 20


@dataclass
class Row:
    """One planned configuration (the JSON row)."""

    stage: int
    offload_optimizer: str
    offload_param: str
    micro_batch: int
    peak_mib: float
    host_mib: float
    construct_mib: float
    fits: bool
    max_micro_batch: int
    mib_per_sample: float = 0.0
    why: str = ''


@dataclass
class Plan:
    """Everything ``plan`` prints."""

    nproc: int
    nnodes: int
    platform: str
    precision: str
    device_mib: float
    host_mib: float
    fixed_mib: float
    engines: list[EngineCensus]
    activations: Activations
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # the config's layout (``config/layout.py``): world_size N, virtual ranks per rank,
    # micro-batches per virtual rank's batch and why, the configured row's peak there
    layout: Optional[dict[str, Any]] = None

    @property
    def micro_batch(self) -> int:
        """The config's micro-batch per rank (every row's)."""
        return self.rows[0].micro_batch if self.rows else self.activations.micro_batch

    @property
    def recommended(self) -> Optional[Row]:
        """The fastest row that fits, or None."""
        return next((row for row in self.rows if row.fits), None)

    def as_json(self) -> dict:
        """The ``--json`` document."""
        recommended = self.recommended
        acts = self.activations
        size = 4 if self.precision == 'fp32' else 2
        saved = acts.bytes_at(self.micro_batch, size)
        transient = acts.transient_at(self.micro_batch, size, self.platform == 'cuda')
        return dict(nproc=self.nproc, nnodes=self.nnodes, platform=self.platform,
                    precision=self.precision, device_mib=round(self.device_mib, 1),
                    fixed_mib=round(self.fixed_mib, 1),
                    rows=[asdict(row) for row in self.rows],
                    recommended=asdict(recommended) if recommended else None,
                    activations=dict(method=acts.method, micro_batch=self.micro_batch,
                                     mib=round(saved / MIB, 1),
                                     transient_mib=round(transient / MIB, 1),
                                     measured_samples=acts.micro_batch, why=acts.note),
                    notes=self.notes, layout=self.layout)


def _total_memory_mib() -> float:
    with open('/proc/meminfo') as meminfo:
        for line in meminfo:
            if line.startswith('MemTotal:'):
                return int(line.split()[1]) / 1024
    raise RuntimeError('no MemTotal in /proc/meminfo: give --device-memory and --host-memory')


def device_memory_mib(nproc: int) -> float:
    """Memory per rank: the CUDA device's, or on the CPU this machine's over ``nproc``."""
    if cuda_available():
        import torch
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / MIB
    return _total_memory_mib() / nproc


def _specs(cfg: Config, ranks: int) -> EngineSpecs:
    """The engines as ``train`` builds them from ``cfg``, resolved for ``ranks`` ranks."""
    specs = EngineSpecs.of_run(cfg.get('ds_config'), getattr(cfg, 'filename', None),
                               cfg.get('train_dataloader'), cfg.get('optim_wrapper'),
                               cfg.get('param_scheduler'))
    specs.resolve(world_size=ranks)
    return specs


def _row_zero(ds_config: dict, stage: int, offload_opt: bool, offload_param: bool,
              model: Any) -> dict:
    ds = copy.deepcopy(ds_config)
    zero = ds.setdefault('zero_optimization', {})
    zero['stage'] = stage
    for part, on in (('optimizer', offload_opt), ('param', offload_param)):
        if on:
            zero[f'offload_{part}'] = dict(zero.get(f'offload_{part}') or {}, device='cpu')
        else:
            zero.pop(f'offload_{part}', None)
    fit_zero_sizes(ds, model)
    return zero


def make_plan(cfg: Config, nproc: int = 1, nnodes: int = 1,
              device_memory_gib: Optional[float] = None,
              host_memory_gib: Optional[float] = None) -> Plan:
    """Plan ``cfg`` on ``nproc`` ranks per node and ``nnodes`` nodes.

    Args:
        cfg (Config): The training config (``train``'s, with its overrides).
        nproc (int): Ranks per node.
        nnodes (int): Nodes.
        device_memory_gib (float, optional): Memory per rank; default the
            CUDA device's, or on the CPU this machine's memory over ``nproc``.
        host_memory_gib (float, optional): Host memory per node for offload;
            default this machine's.

    Returns:
        Plan: The rows and the recommendation.
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f'--nproc {nproc} --nnodes {nnodes}: give at least 1 of each.')
    ranks = nproc * nnodes
    cuda = cuda_available()
    # the fixed cost is taken where the runner takes the one its training log predicts from
    # (DeepSpeedRunner.rss_at_start_mib): imports done, nothing of the config built yet
    import_scope(cfg.get('default_scope', 'mmengine'))
    gc.collect()
    fixed = 0.0 if cuda else rss_mib()
    specs = _specs(cfg, ranks)
    model = meta_model(cfg)
    engines = census(cfg, model)
    batch = one_batch(cfg)
    micro_batch = int(specs.shared('train_micro_batch_size_per_gpu'))
    activations = trace_activations(cfg, meta_model(cfg), batch, micro_batch,
                                    [engine.name for engine in engines])
    mode = specs.precision
    compute_bytes = 4 if mode == 'fp32' else 2
    device_mib = device_memory_gib * 1024 if device_memory_gib is not None \
        else device_memory_mib(nproc)
    host_mib = host_memory_gib * 1024 if host_memory_gib is not None else _total_memory_mib()
    plan = Plan(nproc, nnodes, 'cuda' if cuda else 'cpu', mode, device_mib, host_mib, fixed,
                engines, activations)
    layout = Layout.of(cfg.get('layout'))
    if layout is not None:  # one virtual rank's micro-batch at a time: the same rows
        configured = _configured_row(cfg, specs, engines, activations, ranks, nproc, fixed,
                                     micro_batch)
        split = layout.split(micro_batch, lambda m: configured.peak_mib(m)[0], device_mib)
        micro_batch //= split.count
        plan.layout = dict(world_size=layout.world_size,
                           virtual_ranks_per_rank=layout.per_rank(ranks),
                           micro_batches=split.count, why=split.why,
                           peak_mib=round(configured.peak_mib(micro_batch)[0], 1))
    reference: Optional[dict[str, float]] = None  # ZeRO-0's parts, the first row
    for stage, offload_opt, offload_param in ROWS:
        zeros = {name: _row_zero(ds, stage, offload_opt, offload_param, model)
                 for name, ds in specs.configs().items()}
        row = PeakModel(engines, zeros, activations, MemoryLayout(
            stage, offload_opt, offload_param, compute_bytes, ranks, micro_batch, cuda,
            fills_empty(cfg)),
            fixed, nproc)
        predicted, host = row.peak_mib(micro_batch)
        parts = row.parts(micro_batch)
        reference = reference or parts
        plan.rows.append(Row(stage, 'cpu' if offload_opt else 'none',
                             'cpu' if offload_param else 'none', micro_batch,
                             round(predicted, 1), round(host, 1),
                             round(construction_mib(engines, stage, ranks, cuda, fixed,
                                                    switch(cfg, 'zero_init', None, True)), 1),
                             predicted <= device_mib and host <= host_mib,
                             row.max_micro_batch(device_mib),
                             round(row.peak_mib(micro_batch + 1)[0] - predicted, 2),
                             why_more(parts, reference)))
    for engine in engines:
        if engine.states_note:
            plan.notes.append(f'{engine.name}: {engine.states_note}')
    built_for_real = construction_note(model)  # activations.note says how they were sized
    if built_for_real:
        plan.notes.append(built_for_real)
    transient = activations.transient_at(micro_batch, compute_bytes, cuda)
    if transient:
        plan.notes.append(
            f'a batched matmul reads a {activations.broadcast * compute_bytes / MIB:.0f} MiB '
            'operand broadcast over its batch (a frozen layer\'s weight against an input '
            'that is not contiguous, as nn.MultiheadAttention(batch_first=True) makes): the '
            f'CPU\'s bf16 kernels (oneDNN) copy it whole, {transient / MIB:.0f} MiB per call, '
            'counted in each peak, and slowly; fp32 or a contiguous input avoids both')
    return plan


# What a row's peak is made of (:meth:`PeakModel.parts`), in a word each: the model states
# held all step (parameters, master weights, optimizer states, flat gradient partitions), the
# step's own buffers (buckets, gathered layers, gradients), the activations saved for
# backward, on the CPU what is offloaded to the same memory, what glibc's heap keeps
# (:data:`~.memory.CPU_HEAP_KEPT`) and DeepSpeed's runtime for the stage.
PARTS = ('states', 'buffers', 'activations', 'offload', 'heap', 'runtime')


def why_more(parts: dict[str, float], reference: dict[str, float]) -> str:
    """The part that makes a row's peak larger than ZeRO-0's, in a word ('' where it is
    not larger): the table's ``why`` column."""
    if sum(parts.values()) <= sum(reference.values()) + 0.5:
        return ''
    return max(PARTS, key=lambda name: parts[name] - reference[name])


@dataclass
class PeakModel:
    """One row's bytes as a function of the micro-batch."""

    engines: list[EngineCensus]
    zeros: dict[str, dict]
    activations: Activations
    layout: MemoryLayout
    fixed: float
    nproc: int

    def parts(self, micro_batch: int) -> dict[str, float]:
        """The device peak per rank at ``micro_batch`` beyond the fixed cost, by what holds
        it (MiB; :data:`PARTS`): their sum is the peak. Activations count where the peak is
        backward's; buffers are the moment's own (buckets, gathered layers, gradients)."""
        layout = replace(self.layout, micro_batch=micro_batch)
        total = sum((engine_bytes(e, layout, self.zeros[e.name]) for e in self.engines),
                    Breakdown())
        acts = activation_bytes(self.activations, layout)
        # a kernel's transient comes while part of the activations is saved: counted beside all
        during_backward = total.backward + acts + transient_bytes(self.activations, layout)
        later = max(total.after_backward, total.step)
        parts = dict.fromkeys(PARTS, 0.0)
        parts['states'] = total.held
        if during_backward >= later:
            parts['buffers'] = total.backward
            parts['activations'] = during_backward - total.backward
        else:
            parts['buffers'] = later
        if not layout.cuda:  # one memory: the host's parts and what glibc keeps count too
            model_bytes = sum(4.0 * e.params for e in self.engines)
            parts['offload'] = total.host
            parts['heap'] = cpu_heap_kept(layout.stage, model_bytes, acts)
            parts['runtime'] = CPU_RUNTIME_MIB[layout.stage] * MIB
        return {name: value / MIB for name, value in parts.items()}

    def peak_mib(self, micro_batch: int) -> tuple[float, float]:
        """(device peak per rank, host per node), MiB, at ``micro_batch``."""
        layout = replace(self.layout, micro_batch=micro_batch)
        host = sum(engine_bytes(e, layout, self.zeros[e.name]).host for e in self.engines)
        return self.fixed + sum(self.parts(micro_batch).values()), host * self.nproc / MIB

    def max_micro_batch(self, device_mib: float) -> int:
        """The largest micro-batch whose peak fits ``device_mib`` (0: none)."""
        largest, low, high = 0, 1, MAX_MICRO_BATCH
        while low <= high:  # the peak grows with the micro-batch
            middle = (low + high) // 2
            if self.peak_mib(middle)[0] <= device_mib:
                largest, low = middle, middle + 1
            else:
                high = middle - 1
        return largest


def peak_model(cfg: Config, specs: EngineSpecs, ranks: int, nproc: int, batch: Any,
               samples: int, fixed_mib: float,
               measured: Optional[tuple[nn.Module, tuple[int, int]]] = None) -> PeakModel:
    """The plan's model of a run's peak per rank as a function of its micro-batch: the
    training banner's prediction, and what ``layout.micro_batches='auto'`` fits.

    Args:
        cfg (Config): The run's config (its model as a dict).
        specs (EngineSpecs): The engines (their resolved ds_configs).
        ranks (int): World size.
        nproc (int): Ranks on this node.
        batch (Any): One batch as the loop hands it to ``train_step``.
        samples (int): The samples in ``batch``.
        fixed_mib (float): The process's RSS before the model was built (0 on CUDA).
        measured (tuple, optional): For a model the meta device cannot run: the run's
            own model and the (float bytes, other bytes) its first training step saved
            for backward (:class:`SavedTensorCounter`). The model is then counted on
            the meta device where it builds there, else as the run holds it.

    Raises:
        Exception: Whatever building or tracing on the meta device raises, without
            ``measured`` (no probe here: a second model would raise the memory being
            predicted).
    """
    compute_bytes = 4 if specs.precision == 'fp32' else 2
    if measured is None:
        engines = census(cfg, meta_model(cfg, for_real=False))
        activations = trace_activations(cfg, meta_model(cfg, for_real=False), batch,
                                        samples, [engine.name for engine in engines],
                                        probe=False)
    else:
        model, (floats, others) = measured
        with contextlib.suppress(Exception):  # else its construction needs values: the run's
            model = meta_model(cfg, for_real=False)
        engines = census(cfg, model)
        activations = Activations(floats, others, compute_bytes, samples, 'measured')
    return _configured_row(cfg, specs, engines, activations, ranks, nproc, fixed_mib, samples)


def _configured_row(cfg: Config, specs: EngineSpecs, engines: list[EngineCensus],
                    activations: Activations, ranks: int, nproc: int, fixed_mib: float,
                    micro_batch: int) -> PeakModel:
    """The row of the ZeRO stage and offload the config's ds_config names."""
    offload_optimizer, offload_param = offload_devices(specs.process_config(
        'zero_optimization.offload_optimizer', 'zero_optimization.offload_param'))
    layout = MemoryLayout(specs.zero_stage, offload_optimizer is not None,
                          offload_param is not None, 4 if specs.precision == 'fp32' else 2,
                          ranks, micro_batch, cuda_available(), fills_empty(cfg))
    zeros = {name: ds.get('zero_optimization') or {} for name, ds in specs.configs().items()}
    return PeakModel(engines, zeros, activations, layout, fixed_mib, nproc)


def construction_mib(engines: list[EngineCensus], stage: int, ranks: int, cuda: bool,
                     fixed: float, zero_init: bool = True) -> float:
    """Peak while the runner builds the model: whole, or under zero.Init (ZeRO-3 unless the
    config says ``zero_init=False``) its partition plus the largest layer whole (each module
    is whole while it is built) and a fixed cost (RESULTS.md section 4, measured cold)."""
    params = sum(4.0 * e.params for e in engines)
    if stage != 3 or not zero_init:
        return fixed + params / MIB
    layer = max(4.0 * e.largest_layer for e in engines)
    return fixed + (params / ranks + layer) / MIB + (0.0 if cuda else ZERO_INIT_FIXED_MIB)
