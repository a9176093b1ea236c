"""Writing a checkpoint directory on every rank, complete or not at all.

Order matters for crash safety: DeepSpeed's shards (or, weights only, the
consolidated weights) and every rank's own state first, then the client state
and meta (rank 0), a barrier, and only then the
``COMPLETE`` marker. MMEngine's CheckpointHook writes ``last_checkpoint``
after our save returns, so it never names a checkpoint without the marker.
"""
from __future__ import annotations

import errno
import json
import os
import os.path as osp
import shutil
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from torch import nn

from .layout import (
    CLIENT_FILE,
    FORMAT_VERSION,
    MARKER_FILE,
    META_FILE,
    RANK_FILE,
    STATE_DICT_KEY,
    WEIGHTS_FILE,
    engine_tag,
    find_latest_complete,
    write_text_atomic,
)
from .weights import full_state_dict


def save_checkpoint_dir(path: str, engines: Mapping[str, DeepSpeedEngine], model: nn.Module,
                        client_state: dict[str, Any], rank_state: dict[str, Any],
                        meta: dict[str, Any], weights_only: bool = False) -> None:
    """Save every engine and our state into directory ``path`` (collective).

    Args:
        path (str): The checkpoint directory; an existing one of that name
            (``save_last`` after an interval save) is replaced.
        engines (Mapping[str, DeepSpeedEngine]): The engines, by name; each
            saves into its own tag (see :func:`layout.engine_tag`).
        model (nn.Module): The user's whole model (weights-only: its
            consolidated weights).
        client_state (dict): Meta, message hub, schedulers, hooks' state.
        rank_state (dict): This rank's own state (RNG, buffers).
        meta (dict): JSON-serialisable facts about the run, with ``engines``
            (``{name: submodule path}``) for a model with several engines.
        weights_only (bool): Write the consolidated weights
            (``weights.py``) instead of DeepSpeed's shards: no optimizer
            state. Defaults to False.
    """
    rank = dist.get_rank()
    if rank == 0:
        if osp.isdir(path):
            # Unmark first: a crash while replacing must not look complete.
            marker = osp.join(path, MARKER_FILE)
            if osp.exists(marker):
                os.remove(marker)
            shutil.rmtree(path)  # with any universal conversion cached from the old one
        os.makedirs(path)
    dist.barrier()
    if weights_only:
        state = full_state_dict(model)
        if rank == 0:
            torch.save({STATE_DICT_KEY: state}, osp.join(path, WEIGHTS_FILE))
        del state
        shards = [WEIGHTS_FILE]
    else:
        for name, engine in engines.items():
            # universal_checkpoint_info lets ds_to_universal convert ZeRO-1/2
            # checkpoints without --inject_missing_state (resharding).
            engine.save_checkpoint(path, tag=engine_tag(name), save_latest=False, client_state={
                UNIVERSAL_CHECKPOINT_INFO: {
                    UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}})
    write_rank_state(path, rank_state)
    if rank == 0:
        torch.save(client_state, osp.join(path, CLIENT_FILE))
    dist.barrier()
    if rank == 0:
        if not weights_only:
            shards = sorted(osp.join(tag, name) for tag in map(engine_tag, engines)
                            for name in os.listdir(osp.join(path, tag)))
        meta = dict(meta, format_version=FORMAT_VERSION, shards=shards,
                    optimizer_state=not weights_only)
        write_text_atomic(osp.join(path, META_FILE), json.dumps(meta, indent=2, sort_keys=True))
        write_text_atomic(osp.join(path, MARKER_FILE), 'complete\n')
    dist.barrier()


# How torch's zip writer reports a write the OS refused (it drops errno).
TORCH_WRITE_FAILURES = ('basic_ios::clear', 'unexpected pos', 'file write failed')


def _disk_full(error: BaseException) -> bool:
    seen: Optional[BaseException] = error
    while seen is not None:
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) \
                or 'No space left on device' in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _size(path: str) -> int:
    return sum(osp.getsize(osp.join(folder, name))
               for folder, _, names in os.walk(path) for name in names)


def _gib(size: float) -> str:
    return f'{size / 2**30:.2f} GiB'


def save_failure(path: str, error: BaseException, work_dir: str) -> str:
    """The one message a failed save ends the run with: which, why, and what resumes.

    A full disk shows up as torch's zip writer failing ("unexpected pos",
    "basic_ios::clear") as often as "No space left on device"; it is named
    when the error says so or when less space is free than the last
    complete checkpoint took.

    Args:
        path (str): The checkpoint directory being written.
        error (BaseException): What the save raised.
        work_dir (str): The runner's work directory (``--resume`` looks there).

    Returns:
        str: The message.
    """
    folder = osp.dirname(osp.abspath(path))
    latest = find_latest_complete(folder)[0] or find_latest_complete(work_dir)[0]
    cause = f'{type(error).__name__}: {error}'
    free = shutil.disk_usage(folder).free
    needed = _size(latest) if latest is not None else None
    if _disk_full(error) or (needed is not None and free < needed):
        cause = (f'the disk is full: {_gib(free)} free in {folder}'
                 + (f', and the last checkpoint took {_gib(needed)}' if needed is not None
                    else '') + f' ({cause})')
    elif any(sign in str(error) for sign in TORCH_WRITE_FAILURES):
        cause = (f'writing a file failed ({cause}: torch\'s file writer hides why; a full '
                 f'disk, a quota or a file-size limit; {_gib(free)} free in {folder})')
    resumes = (f'the last complete checkpoint, which --resume (resume=True) uses, is {latest}'
               if latest is not None else
               'there is no complete checkpoint yet, so --resume would start from scratch')
    return (f'Saving checkpoint {path} failed: {cause}. It is left incomplete (no COMPLETE '
            f'marker) and is never resumed from; {resumes}. Fix the cause (free space, or '
            'another out_dir) and resume.')


def write_rank_state(path: str, rank_state: dict[str, Any]) -> None:
    """This rank's own state into checkpoint ``path`` (a temporary file, then renamed: a
    complete checkpoint keeps a whole rank file whenever this is cut short)."""
    target = osp.join(path, RANK_FILE.format(rank=dist.get_rank()))
    tmp = f'{target}.tmp{os.getpid()}'
    torch.save(rank_state, tmp)
    os.replace(tmp, target)
