"""Training from a config file: in this process, or in N local ones.

What ``mmengine-deepspeed train`` and the demo run, with explicit arguments: the config
file plus the command line's overrides, then ``RUNNERS.build(cfg).train()`` in each process
(``launch.py`` starts them).
"""
from __future__ import annotations

import os.path as osp
from typing import Any, Callable, Optional

from mmengine.config import Config


def load_train_config(config: str, work_dir: Optional[str], launcher: str, cfg_options: dict,
                      resume: Optional[str] = None, zero: Optional[int] = None,
                      ds_config: Optional[str] = None) -> Config:
    """The config ``train`` runs: the file plus the command-line overrides."""
    from .config.resolve import load_ds_config

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
    if ds_config is not None:
        cfg.ds_config = osp.abspath(ds_config)
    if zero is not None:
        resolved = load_ds_config(cfg.get('ds_config'), osp.dirname(osp.abspath(config)))
        resolved.setdefault('zero_optimization', {})['stage'] = zero
        cfg.ds_config = resolved
    if resume is not None:
        cfg.resume = True
        cfg.load_from = None if resume == 'auto' else resume
    return cfg


def run_training(config: str, work_dir: Optional[str], launcher: str, cfg_options: dict,
                 resume: Optional[str] = None, zero: Optional[int] = None,
                 ds_config: Optional[str] = None) -> str:
    """Build the runner the config asks for (DeepSpeedRunner by default) and train.

    Module-level, so that ``nproc`` > 1 can hand it to each process (importing
    this package registered DeepSpeedRunner).

    Returns:
        str: The work directory.
    """
    from mmengine.registry import RUNNERS

    cfg = load_train_config(config, work_dir, launcher, cfg_options, resume, zero, ds_config)
    runner = RUNNERS.build(cfg)  # type: ignore[arg-type]  # a Config, as MMEngine's tools pass
    if runner.rank == 0:
        print(f'mmengine-deepspeed: logs in {runner.log_dir}, checkpoints in {runner.work_dir}',
              flush=True)
    runner.train()
    return str(runner.work_dir)


def train_config(config: str, *, nproc: int = 1, work_dir: Optional[str] = None,
                 launcher: str = 'none', cfg_options: Optional[dict] = None,
                 resume: Optional[str] = None, zero: Optional[int] = None,
                 ds_config: Optional[str] = None, max_restarts: int = 0,
                 entrypoint: Callable[..., str] = run_training,
                 extra: tuple[Any, ...] = ()) -> str:
    """Train ``config`` in this process, or in ``nproc`` new ones.

    Args:
        config (str): The MMEngine config file.
        nproc (int): Local processes to start (1: this process). Defaults to 1.
        work_dir (str, optional): Overrides the config's. Defaults to None.
        launcher (str): How this process was started, for ``nproc`` 1.
            Defaults to ``'none'``.
        cfg_options (dict, optional): Config keys to override. Defaults to None.
        resume (str, optional): A checkpoint, or ``'auto'`` (the latest
            complete one). Defaults to None.
        zero (int, optional): A ZeRO stage override. Defaults to None.
        ds_config (str, optional): A DeepSpeed JSON config. Defaults to None.
        max_restarts (int): Restarts of all processes when one dies. Defaults to 0.
        entrypoint (Callable): What each process runs, with :func:`run_training`'s
            arguments and then ``extra`` (module-level: it is pickled). Defaults to
            :func:`run_training`.
        extra (tuple): Further arguments of ``entrypoint``. Defaults to ().

    Returns:
        str: The work directory.
    """
    if nproc < 1 or max_restarts < 0:
        raise ValueError(f'--nproc {nproc} --max-restarts {max_restarts}: give at '
                         'least 1 process and 0 or more restarts.')
    call = (config, work_dir, launcher, cfg_options or {}, resume, zero, ds_config, *extra)
    if nproc == 1 and max_restarts == 0:
        return entrypoint(*call)
    if launcher != 'none':
        raise ValueError(f'--nproc {nproc} / --max-restarts start the processes here; drop '
                         f'--launcher {launcher} (or use that launcher\'s own restarts).')
    from .launch import launch_local

    results = launch_local(entrypoint, nproc, *call[:2], 'pytorch', *call[3:],
                           max_restarts=max_restarts)
    return str(results[0])
