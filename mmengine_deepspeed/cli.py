"""``mmengine-deepspeed``: the command line.

``train CONFIG`` is the OpenMMLab ``tools/train.py`` with DeepSpeedRunner as
the default runner: run it directly for one process, or under ``torchrun`` /
``srun`` / ``mpirun`` with ``--launcher``.
"""
from __future__ import annotations

import argparse
import os
import os.path as osp
import sys
from collections.abc import Sequence
from typing import Optional

from mmengine.config import Config, DictAction


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one sub-command per verb."""
    parser = argparse.ArgumentParser(prog='mmengine-deepspeed',
                                     description='Train MMEngine models with DeepSpeed.')
    sub = parser.add_subparsers(dest='command', required=True)
    train = sub.add_parser('train', help='train from an MMEngine config file')
    train.add_argument('config', help='the MMEngine config file')
    train.add_argument('--work-dir', help='where logs and checkpoints go')
    train.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                       default='none', help='how the processes were started')
    train.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                       help='override config keys, e.g. train_cfg.max_iters=10')
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
    inspect_cmd = sub.add_parser('inspect', help='describe a checkpoint directory')
    inspect_cmd.add_argument('checkpoint', help='a DeepSpeedRunner checkpoint directory')
    return parser


def train(config: str, work_dir: Optional[str], launcher: str, cfg_options: dict) -> None:
    """Build the runner the config asks for (DeepSpeedRunner by default) and train.

    Args:
        config (str): Path of the MMEngine config file.
        work_dir (str, optional): Overrides ``cfg.work_dir``.
        launcher (str): ``none``, ``pytorch``, ``slurm`` or ``mpi``.
        cfg_options (dict): Dotted-key overrides.
    """
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed  # noqa: F401  registers DeepSpeedRunner

    if not osp.isfile(config):
        raise FileNotFoundError(f'config file not found: {config!r}')
    cfg = Config.fromfile(config)
    cfg.merge_from_dict(cfg_options)
    cfg.launcher = launcher
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('work_dirs', osp.splitext(osp.basename(config))[0])
    cfg.setdefault('runner_type', 'DeepSpeedRunner')
    runner = RUNNERS.build(cfg)
    runner.logger.info(f'Logs and checkpoints go to {osp.abspath(cfg.work_dir)}')
    runner.train()


def describe(path: str) -> str:
    """What ``inspect`` prints: the meta, completeness, size and shard files."""
    from .checkpoint.layout import (
        CheckpointError,
        check_checkpoint,
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
    lines.append(f'versions: {meta.get("versions")}')
    size = sum(osp.getsize(osp.join(root, f)) for root, _, files in os.walk(path) for f in files)
    lines.append(f'size: {size / 2**20:.2f} MiB')
    lines.append(f'complete: {status}')
    lines.append('shards:')
    lines += [f'  {osp.relpath(f, path)} ({osp.getsize(f) / 2**20:.2f} MiB)'
              for f in shard_files(path)]
    return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; our errors print as one line, exit 2."""
    from .checkpoint.layout import CheckpointError
    from .config import DsConfigError

    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (CheckpointError, DsConfigError, FileNotFoundError, ValueError) as e:
        print(f'mmengine-deepspeed {args.command}: error: {e}', file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == 'train':
        os.environ.setdefault('OMP_NUM_THREADS', '1')
        train(args.config, args.work_dir, args.launcher, args.cfg_options)
    elif args.command == 'convert':
        from .checkpoint.export import export_checkpoint

        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype,
                                safetensors=args.safetensors, allow_unsafe=args.allow_unsafe,
                                ema=args.ema)
        print(f'wrote {out}')
    elif args.command == 'inspect':
        print(describe(args.checkpoint))
    return 0
