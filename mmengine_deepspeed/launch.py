"""Start N local training processes through PyTorch's elastic launch API.

``mmengine-deepspeed train --nproc N`` uses this instead of shelling out to
``torchrun`` or ``deepspeed`` (which may be missing, or need pdsh). The
processes rendezvous on a free loopback port; a failure in one stops all, or
restarts all (``max_restarts``), which then resume from the latest checkpoint.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .dist import free_port


def launch_local(entrypoint: Callable[..., Any], nproc: int, *args: Any,
                 max_restarts: int = 0) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` processes on this machine.

    Each process gets torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so it initialises with
    ``launcher='pytorch'``. ``OMP_NUM_THREADS`` defaults to the cores per
    process.

    Args:
        entrypoint (Callable): A module-level function (it is pickled).
        nproc (int): Number of processes.
        *args: Its arguments.
        max_restarts (int): How often the elastic agent restarts all
            processes after one fails; each restart resumes from the latest
            complete checkpoint (``DeepSpeedRunner``). Defaults to 0.

    Returns:
        dict[int, Any]: Return values by local rank.
    """
    os.environ.setdefault('OMP_NUM_THREADS', str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f'mmds-{uuid.uuid4().hex[:8]}',
        rdzv_backend='c10d', rdzv_endpoint=f'127.0.0.1:{free_port()}', max_restarts=max_restarts,
        monitor_interval=0.5, start_method='spawn')
    return elastic_launch(config, entrypoint)(*args)
