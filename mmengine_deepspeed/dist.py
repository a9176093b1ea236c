"""Process-group setup that works with and without CUDA.

MMEngine's ``init_dist`` calls ``torch.cuda.set_device`` for every launcher,
which fails on a machine without CUDA, and DeepSpeed needs a process group even
for a single process. This module sets the group up for the launchers MMEngine
knows (``none``, ``pytorch``, ``slurm``, ``mpi``) with gloo on CPU and nccl on
CUDA, and always with a timeout, so that a rank whose peer died raises instead
of waiting forever.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import subprocess
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as torch_dist
from mmengine.logging import print_log

from .compat import cpu_probes, release_process_group_references
from .failure import rank_failed, stop_watching, watch_for_peer_failures
from .ops import skip_inference_ops

LAUNCHERS = ('none', 'pytorch', 'slurm', 'mpi')
DEFAULT_TIMEOUT_S = 1800
DEFAULT_PORT = 29500


def cuda_available() -> bool:
    """Whether this process can use CUDA (False on CPU-only builds)."""
    return torch.cuda.is_available()


def native_bf16() -> bool:
    """Whether bf16 math runs natively here, rather than emulated in fp32 code paths.

    On CUDA, what the device reports. On CPU, AVX512-BF16 or AMX: without
    them torch emulates bf16, measured 3.6-4.5x slower per iteration than
    fp32 on the demo (AMD EPYC, AVX2 only). torch exposes its CPU probes
    (cpuinfo) only under private names; tests/unit/test_upstream_traps.py
    pins them against /proc/cpuinfo. Other CPUs (Arm) count as not native.
    """
    if cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    return any(bool(probe()) for probe in cpu_probes())


def choose_backend(requested: Optional[str], has_cuda: bool) -> str:
    """The backend to use: nccl needs CUDA, so fall back to gloo without it.

    MMEngine's default ``env_cfg`` asks for nccl, so almost every config says
    nccl; on a CPU machine that means "the default", not "fail".

    Args:
        requested (str, optional): ``env_cfg.dist_cfg.backend``.
        has_cuda (bool): Whether CUDA is usable.

    Returns:
        str: ``'nccl'`` or ``'gloo'`` (or the requested backend otherwise).
    """
    if requested is None:
        return 'nccl' if has_cuda else 'gloo'
    if requested == 'nccl' and not has_cuda:
        print_log('env_cfg.dist_cfg.backend="nccl" needs CUDA; using gloo on this machine.',
                  logger='current')
        return 'gloo'
    return requested


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return int(s.getsockname()[1])


def _env_int(*names: str, default: Optional[int] = None) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    if default is None:
        raise RuntimeError(
            f'None of the environment variables {names} is set: start the job with the '
            'launcher it names (torchrun for launcher="pytorch", srun for "slurm", '
            'mpirun for "mpi").')
    return default


def _slurm_master_addr() -> str:
    nodes = os.environ['SLURM_NODELIST']
    out = subprocess.run(['scontrol', 'show', 'hostnames', nodes], capture_output=True,
                         text=True, check=True).stdout
    return out.split()[0]


def _launcher_env(launcher: str, port: Optional[int]) -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* for ``launcher``."""
    if launcher == 'none':
        return {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0',
                'MASTER_ADDR': os.environ.get('MASTER_ADDR', '127.0.0.1'),
                'MASTER_PORT': os.environ.get('MASTER_PORT', str(port or free_port()))}
    if launcher == 'pytorch':
        return {'RANK': str(_env_int('RANK')), 'WORLD_SIZE': str(_env_int('WORLD_SIZE')),
                'LOCAL_RANK': str(_env_int('LOCAL_RANK', default=0)),
                'MASTER_ADDR': os.environ.get('MASTER_ADDR', '127.0.0.1'),
                'MASTER_PORT': os.environ.get('MASTER_PORT', str(port or DEFAULT_PORT))}
    if launcher == 'slurm':
        addr = os.environ.get('MASTER_ADDR') or _slurm_master_addr()
        return {'RANK': str(_env_int('SLURM_PROCID')),
                'WORLD_SIZE': str(_env_int('SLURM_NTASKS')),
                'LOCAL_RANK': str(_env_int('SLURM_LOCALID', default=0)),
                'MASTER_ADDR': addr,
                'MASTER_PORT': str(port or os.environ.get('MASTER_PORT', DEFAULT_PORT))}
    if launcher == 'mpi':
        return {'RANK': str(_env_int('OMPI_COMM_WORLD_RANK', 'PMI_RANK')),
                'WORLD_SIZE': str(_env_int('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE')),
                'LOCAL_RANK': str(_env_int('OMPI_COMM_WORLD_LOCAL_RANK', 'MPI_LOCALRANKID',
                                           default=0)),
                'MASTER_ADDR': os.environ.get('MASTER_ADDR', '127.0.0.1'),
                'MASTER_PORT': str(port or os.environ.get('MASTER_PORT', DEFAULT_PORT))}
    raise ValueError(f'launcher={launcher!r} is not supported; use one of {LAUNCHERS}.')


# DeepSpeed 0.19 calls these deprecated torch.distributed functions on every
# step of ZeRO; each rank would print the FutureWarning once per process.
def init_distributed(launcher: str, dist_cfg: Optional[Mapping[str, Any]] = None) -> None:
    """Initialise the default process group for ``launcher`` if none exists.

    Args:
        launcher (str): One of ``'none'`` (one process, still a process
            group, since DeepSpeed needs one), ``'pytorch'``, ``'slurm'``,
            ``'mpi'``.
        dist_cfg (Mapping, optional): MMEngine's ``env_cfg.dist_cfg``:
            ``backend``, ``timeout`` (seconds) and ``port`` are honoured.
            Defaults to None.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f'launcher={launcher!r} is not supported; use one of {LAUNCHERS}.')
    if not cuda_available():
        skip_inference_ops()  # before DeepSpeed's communication backend exists
    if torch_dist.is_initialized():
        return
    cfg = dict(dist_cfg or {})
    unknown = set(cfg) - {'backend', 'timeout', 'port'}
    if unknown:
        raise ValueError(f'env_cfg.dist_cfg has unsupported keys {sorted(unknown)}; '
                         'DeepSpeedRunner honours backend, timeout and port.')
    has_cuda = cuda_available()
    backend = choose_backend(cfg.get('backend'), has_cuda)
    timeout = datetime.timedelta(seconds=float(cfg.get('timeout', DEFAULT_TIMEOUT_S)))
    env = _launcher_env(launcher, cfg.get('port'))
    os.environ.update(env)
    if has_cuda:
        torch.cuda.set_device(int(env['LOCAL_RANK']) % torch.cuda.device_count())
    rank, world_size = int(env['RANK']), int(env['WORLD_SIZE'])
    restart = os.environ.get('TORCHELASTIC_RESTART_COUNT') or '0'
    # Our keys in the rendezvous store, new for every world and restart.
    prefix = f'mmengine_deepspeed/restart{restart}/world{_worlds_created[0]}/'
    if _worlds_created[0] == 0 and restart == '0':
        torch_dist.init_process_group(backend=backend, init_method='env://', rank=rank,
                                      world_size=world_size, timeout=timeout)
    else:
        # A world after one that was destroyed in this process, or after the
        # elastic agent restarted the job: the rendezvous store may still hold
        # the old world's addresses under torch's default keys, and gloo would
        # connect to those (dead) peers. A key prefix of our own avoids them.
        store, _, _ = next(torch_dist.rendezvous('env://', rank, world_size, timeout=timeout))
        torch_dist.init_process_group(backend=backend, store=torch_dist.PrefixStore(prefix, store),
                                      rank=rank, world_size=world_size, timeout=timeout)
        forget_destroyed_groups()
    if _worlds_created[0] == 0:
        atexit.register(_destroy_process_group)
    _worlds_created[0] += 1
    watch_for_peer_failures(prefix, rank, world_size)


# Worlds this process has created (a list, to be updated in place).
_worlds_created = [0]


def forget_destroyed_groups() -> None:
    """Drop DeepSpeed's references to the process groups of an earlier world.

    DeepSpeed caches a clone of the world group (and its parallel groups) in
    ``deepspeed.utils.groups`` and releases them only when the world is torn
    down through ``deepspeed.comm.destroy_process_group``. After
    ``torch.distributed.destroy_process_group()`` (scripts, notebooks, sweeps,
    test suites) the next ``deepspeed.initialize`` would use the dead clone
    ("Group ... is not registered"). Called right after a new world group is
    created, when every cached group necessarily belongs to the old world.
    ``_release_process_group_references`` is private (DeepSpeed's own
    ``destroy_process_group`` calls it); tests/dist/test_runner_contract.py
    trains a second runner after destroying the first one's group.
    """
    release_process_group_references()


# How long a finishing rank waits at exit for the others to finish too.
EXIT_BARRIER_TIMEOUT_S = 10


def _destroy_process_group() -> None:
    # A gloo group still alive when the interpreter shuts down can abort the
    # process ("terminate called without an active exception", exit -6) after
    # training finished; tearing it down at exit makes the exit clean. The
    # ranks first wait for each other: one that destroys its gloo pairs while
    # a peer is still finishing aborted one of them at exit in 2 of 12
    # 2-rank launches (none of 12 with the barrier). Bounded by a timeout,
    # since after a failure the peers may never arrive.
    # A rank that failed (or saw a peer fail) does not wait: its peers are
    # gone or going (failure.py).
    failed = rank_failed()
    stop_watching()
    if not torch_dist.is_initialized():
        return
    if torch_dist.get_backend() == 'gloo' and torch_dist.get_world_size() > 1 and not failed:
        # a peer that failed or is gone raises here: tear down anyway
        with contextlib.suppress(RuntimeError):
            torch_dist.monitored_barrier(
                timeout=datetime.timedelta(seconds=EXIT_BARRIER_TIMEOUT_S))
    torch_dist.destroy_process_group()


def local_world_size(world_size: int) -> int:
    """The ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; all of ``world_size``
    without it)."""
    return int(os.environ.get('LOCAL_WORLD_SIZE', world_size))


_CPU_GROUP: dict[str, Any] = {}  # 'world': the default group it was made for, 'group'


def cpu_group() -> Any:
    """A gloo group over all ranks, for small all-reduces of CPU data (checks, agreements).

    Through NCCL such data would make the CPU wait for the GPU's queued work
    before its value could be read. Created once per default group
    (collectively, at the first use, which every rank reaches in the same
    iteration).
    """
    world = torch_dist.group.WORLD
    if torch_dist.get_backend() == 'gloo':
        return world
    if _CPU_GROUP.get('world') is not world:
        _CPU_GROUP.update(world=world, group=torch_dist.new_group(backend='gloo'))
    return _CPU_GROUP['group']
