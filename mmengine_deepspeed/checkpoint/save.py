"""Writing a checkpoint directory on every rank, complete or not at all.

Order matters for crash safety: DeepSpeed's shards and every rank's own state
first, then the client state and meta (rank 0), a barrier, and only then the
``COMPLETE`` marker. MMEngine's CheckpointHook writes ``last_checkpoint``
after our save returns, so it never names a checkpoint without the marker.
"""
from __future__ import annotations

import json
import os
import os.path as osp
import shutil
from typing import Any

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)

from .layout import (
    CLIENT_FILE,
    DS_TAG,
    FORMAT_VERSION,
    MARKER_FILE,
    META_FILE,
    RANK_FILE,
    write_text_atomic,
)
from .state import rank_state


def save_checkpoint_dir(path: str, engine: DeepSpeedEngine, client_state: dict[str, Any],
                        meta: dict[str, Any]) -> None:
    """Save ``engine`` and our state into directory ``path`` (collective).

    Args:
        path (str): The checkpoint directory; an existing one of that name
            (``save_last`` after an interval save) is replaced.
        engine (DeepSpeedEngine): The engine to save.
        client_state (dict): Meta, message hub, schedulers, hooks' state.
        meta (dict): JSON-serialisable facts about the run (also stored in
            ``client_state['meta']``).
    """
    rank = dist.get_rank()
    if rank == 0:
        if osp.isdir(path):
            # Unmark first: a crash while overwriting must not look complete.
            marker = osp.join(path, MARKER_FILE)
            if osp.exists(marker):
                os.remove(marker)
            shutil.rmtree(osp.join(path, DS_TAG), ignore_errors=True)
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    # universal_checkpoint_info lets ds_to_universal convert ZeRO-1/2
    # checkpoints without --inject_missing_state (resharding).
    engine.save_checkpoint(path, tag=DS_TAG, save_latest=False, client_state={
        UNIVERSAL_CHECKPOINT_INFO: {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}})
    torch.save(rank_state(engine.module), osp.join(path, RANK_FILE.format(rank=rank)))
    if rank == 0:
        torch.save(client_state, osp.join(path, CLIENT_FILE))
    dist.barrier()
    if rank == 0:
        meta = dict(meta, format_version=FORMAT_VERSION,
                    shards=sorted(os.listdir(osp.join(path, DS_TAG))))
        write_text_atomic(osp.join(path, META_FILE), json.dumps(meta, indent=2, sort_keys=True))
        write_text_atomic(osp.join(path, MARKER_FILE), 'complete\n')
    dist.barrier()
