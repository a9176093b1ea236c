"""``mmengine-deepspeed``: train, plan, demo, plot, convert, inspect.

``train CONFIG`` is the OpenMMLab ``tools/train.py`` with DeepSpeedRunner as the
default runner. With ``--nproc N`` it starts N local processes itself (PyTorch's
elastic launch API); under ``torchrun`` / ``srun`` / ``mpirun`` pass
``--launcher``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import os.path as osp
import sys
from collections.abc import Sequence
from typing import Any, Optional

from mmengine.config import DictAction


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one sub-command per verb."""
    parser = argparse.ArgumentParser(prog='mmengine-deepspeed',
                                     description='Train MMEngine models with DeepSpeed.')
    sub = parser.add_subparsers(dest='command', required=True)
    train = sub.add_parser('train', help='train from an MMEngine config file')
    train.add_argument('config', help='the MMEngine config file')
    train.add_argument('--nproc', type=int, default=1,
                       help='start this many local processes (default 1)')
    train.add_argument('--work-dir', help='where logs and checkpoints go')
    train.add_argument('--resume', nargs='?', const='auto', metavar='CKPT',
                       help='resume from CKPT, or from the latest complete checkpoint')
    train.add_argument('--zero', type=int, choices=[0, 1, 2, 3], help='ZeRO stage override')
    train.add_argument('--ds-config', metavar='FILE', help='a DeepSpeed JSON config')
    train.add_argument('--max-restarts', type=int, default=0, metavar='K',
                       help='restart all processes up to K times when one dies; each restart '
                            'resumes from the latest complete checkpoint (default 0)')
    train.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                       default='none', help='how the processes were started')
    train.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                       help='override config keys, e.g. train_cfg.max_iters=10')
    plan = sub.add_parser('plan', help='per-rank memory of a config under each ZeRO stage and '
                                       'offload, before launching')
    plan.add_argument('config', help='the MMEngine config file')
    plan.add_argument('--nproc', type=int, default=1, help='ranks per node (default 1)')
    plan.add_argument('--nnodes', type=int, default=1, help='nodes (default 1)')
    plan.add_argument('--device-memory', type=float, metavar='GiB',
                      help="memory per rank (default: the GPU's, or this machine's over --nproc)")
    plan.add_argument('--host-memory', type=float, metavar='GiB',
                      help="host memory per node for offload (default: this machine's)")
    plan.add_argument('--zero', type=int, choices=[0, 1, 2, 3], help='ZeRO stage override')
    plan.add_argument('--ds-config', metavar='FILE', help='a DeepSpeed JSON config')
    plan.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                      help='override config keys, e.g. train_dataloader.batch_size=8')
    plan.add_argument('--json', action='store_true', help='print the plan as JSON')
    demo = sub.add_parser('demo', help='train a tiny GPT on the stdlib source (about a minute)')
    demo.add_argument('--nproc', type=int, default=2)
    demo.add_argument('--zero', type=int, choices=[0, 1, 2, 3], default=3)
    demo.add_argument('--max-iters', type=int, default=300)
    demo.add_argument('--work-dir', default=osp.join('work_dirs', 'demo'))
    plot = sub.add_parser('plot', help='loss / learning-rate curves of a run as PNG')
    plot.add_argument('work_dir', help="the run's work directory")
    plot.add_argument('--out', help='the PNG to write (default WORK_DIR/curves.png)')
    convert = sub.add_parser('convert', help='export a checkpoint as one weights file')
    convert.add_argument('checkpoint', help='a DeepSpeedRunner checkpoint directory')
    convert.add_argument('out', help='the .pth (or .safetensors) file to write')
    convert.add_argument('--dtype', choices=['fp32', 'bf16', 'fp16'], default='fp32')
    convert.add_argument('--safetensors', action='store_true',
                         help='write safetensors (default: a torch .pth)')
    convert.add_argument('--ema', action='store_true',
                         help='export the EMA weights (runs with EMAHook)')
    convert.add_argument('--allow-unsafe', action='store_true',
                         help='load shards with full unpickling (trusted files only)')
    inspect_cmd = sub.add_parser('inspect', help='describe a checkpoint directory or weights file')
    inspect_cmd.add_argument('checkpoint', help='a DeepSpeedRunner checkpoint directory, or '
                             'a weights file (convert\'s .pth or .safetensors)')
    return parser


def train(args: argparse.Namespace) -> str:
    """``train``: in this process, or in ``--nproc`` new ones."""
    from .training import train_config

    return train_config(args.config, nproc=args.nproc, work_dir=args.work_dir,
                        launcher=args.launcher, cfg_options=args.cfg_options, resume=args.resume,
                        zero=args.zero, ds_config=args.ds_config,
                        max_restarts=args.max_restarts)


def describe(path: str) -> str:
    """What ``inspect`` prints: the meta, completeness, size and shard files; for a
    weights file (``convert``'s, or MMEngine's), its meta, tensors and size."""
    if osp.isfile(path):
        from .checkpoint.export import describe_weights

        return '\n'.join(describe_weights(path))
    from .checkpoint.layout import (
        CheckpointError,
        check_checkpoint,
        engine_modules,
        has_optimizer_state,
        is_complete,
        read_meta,
        shard_files,
    )

    lines = [f'checkpoint: {osp.abspath(path)}']
    try:
        check_checkpoint(path)
        status = 'yes'
    except CheckpointError as e:
        status = f'no ({e})'
    if not is_complete(path):
        status = 'no (COMPLETE marker missing: the save did not finish)'
    meta = read_meta(path)
    for key in ('epoch', 'iter', 'world_size', 'zero_stage', 'precision', 'seed'):
        lines.append(f'{key}: {meta.get(key)}')
    lines.append('optimizer state: ' + ('yes (DeepSpeed shards)' if has_optimizer_state(meta)
                                        else 'no (weights only)'))
    lines.append('engines: ' + ', '.join(
        f'{name} (model.{path})' if path else f'{name} (the whole model)'
        for name, path in engine_modules(meta).items()))
    lines.append(f'versions: {meta.get("versions")}')
    size = sum(osp.getsize(osp.join(root, f)) for root, _, files in os.walk(path) for f in files)
    lines.append(f'size: {size / 2**20:.2f} MiB')
    lines.append(f'complete: {status}')
    lines.append('shards:')
    lines += [f'  {osp.relpath(f, path)} ({osp.getsize(f) / 2**20:.2f} MiB)'
              for f in shard_files(path)]
    return '\n'.join(lines)


def print_plan(args: argparse.Namespace) -> Any:
    """``plan``: the config as ``train`` would resolve it, planned and printed."""
    import json

    import mmengine_deepspeed  # noqa: F401  registers DeepSpeed's optimizers and constructors

    from .config.resolve import DsConfigError
    from .plan.planner import make_plan
    from .plan.report import plan_text
    from .training import load_train_config
    from .zero.partitioned import construction_failure

    # stdout carries the plan alone (--json is read by programs): what the config's libraries
    # print or log while it is sized (MMEngine's logger writes to stdout) goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        cfg = load_train_config(args.config, None, 'none', args.cfg_options, zero=args.zero,
                                ds_config=args.ds_config)
        try:
            plan = make_plan(cfg, nproc=args.nproc, nnodes=args.nnodes,
                             device_memory_gib=args.device_memory,
                             host_memory_gib=args.host_memory)
        except (DsConfigError, ValueError):
            raise
        except Exception as e:  # the model's own code failed: one line naming where, exit 2
            raise ValueError(f'{args.config}: the model could not be sized, neither on the '
                             'meta device nor with one real step '
                             f'({construction_failure(e)}). Train it for a few iterations '
                             'and read peak_mem_mb in its log.') from e
    print(json.dumps(plan.as_json(), indent=2) if args.json else plan_text(plan))
    return plan


def _run(args: argparse.Namespace) -> Any:
    if args.command == 'train':
        return train(args)
    if args.command == 'plan':
        return print_plan(args)
    if args.command == 'demo':
        from .demo.run import run_demo

        return run_demo(nproc=args.nproc, zero=args.zero, max_iters=args.max_iters,
                        work_dir=args.work_dir)
    if args.command == 'plot':
        from .plot import plot_run

        print(f'wrote {plot_run(args.work_dir, args.out)}')
    elif args.command == 'convert':
        from .checkpoint.export import export_checkpoint

        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype,
                                safetensors=args.safetensors, allow_unsafe=args.allow_unsafe,
                                ema=args.ema)
        print(f'wrote {out}')
    elif args.command == 'inspect':
        print(describe(args.checkpoint))
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; our errors print as one line, exit 2."""
    args = build_parser().parse_args(argv)
    # Like `python -m`: configs' custom_imports may name modules of the
    # project in the working directory (processes started by --nproc inherit it).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from .checkpoint.layout import CheckpointError
    from .config.resolve import DsConfigError

    try:
        _run(args)
    except (CheckpointError, DsConfigError, FileNotFoundError, ValueError) as e:
        print(f'mmengine-deepspeed {args.command}: error: {e}', file=sys.stderr)
        return 2
    return 0
