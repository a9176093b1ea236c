"""``mmengine-deepspeed``: the command line.

``train CONFIG`` is the OpenMMLab ``tools/train.py`` with DeepSpeedRunner as
the default runner: run it directly for one process, or under ``torchrun`` /
``srun`` / ``mpirun`` with ``--launcher``.
"""
from __future__ import annotations

import argparse
import os
import os.path as osp
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    if args.command == 'train':
        os.environ.setdefault('OMP_NUM_THREADS', '1')
        train(args.config, args.work_dir, args.launcher, args.cfg_options)
    return 0
