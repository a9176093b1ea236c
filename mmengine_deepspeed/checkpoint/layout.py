"""What a DeepSpeedRunner checkpoint directory holds, and how it is checked.

A checkpoint is one directory (named as MMEngine's CheckpointHook names it,
e.g. ``epoch_3.pth`` or ``iter_2000.pth``)::

    epoch_3.pth/
      deepspeed/                  DeepSpeed's shards (engine.save_checkpoint, tag "deepspeed")
      deepspeed-<name>/           instead, one per engine of a model with several optimizers
                                  (a GAN's ``deepspeed-generator/``, ``deepspeed-discriminator/``)
      client_state.pt             meta, message hub, param schedulers, hooks' state
      rank_state_rank{R}.pt       rank R's RNG states (python, numpy, torch, CUDA) and
                                  module buffers (BatchNorm statistics are per rank)
      meta.json                   the meta again, readable without torch
      COMPLETE                    written by rank 0 last, after every rank finished

A weights-only checkpoint (``save_optimizer=False``, or a save before
``train()`` built an optimizer) holds ``weights.pt`` in place of DeepSpeed's
shards: the consolidated state dict, fp32 masters where DeepSpeed keeps them
(``weights.py``), under ``state_dict`` as MMEngine's checkpoints hold it.
Its meta says ``"optimizer_state": false``; it loads on any world size and
ZeRO stage.

A directory without ``COMPLETE`` is a save that did not finish (a crash, a
kill); it is never resumed from.
"""
from __future__ import annotations

import glob
import json
import os
import os.path as osp
import re
import zipfile
from typing import Any, Optional

from ..engine.spec import SINGLE_ENGINE

DS_TAG = 'deepspeed'
CLIENT_FILE = 'client_state.pt'
META_FILE = 'meta.json'
MARKER_FILE = 'COMPLETE'
RANK_FILE = 'rank_state_rank{rank}.pt'
WEIGHTS_FILE = 'weights.pt'
# DeepSpeed's model-state file in an engine's tag directory, below ZeRO-3 and at ZeRO-3.
ZERO0_MODEL_FILE = 'mp_rank_00_model_states.pt'
ZERO3_MODEL_FILE = 'zero_pp_rank_0_mp_rank_00_model_states.pt'
LAST_CHECKPOINT = 'last_checkpoint'
# 2: ``shards`` are paths relative to the checkpoint and ``engines`` names each
# engine's submodule; 1 (one engine, shards inside DS_TAG) is still read.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)

# The keys of the client state (CLIENT_FILE); ``parts.py`` saves and loads
# each, hooks add their own (EMA_KEY: MMEngine's EMAHook's name).
META_KEY = 'meta'
MESSAGE_HUB_KEY = 'message_hub'
PARAM_GROUPS_KEY = 'optimizer_param_groups'
PARAM_SCHEDULERS_KEY = 'param_schedulers'
# Parameters and buffers of a model with several engines that no engine
# holds (rank 0's), keys as in ``model.state_dict()``.
OUTSIDE_ENGINES_KEY = 'outside_engines'
EMA_KEY = 'ema_state_dict'
# The weights in WEIGHTS_FILE and in MMEngine's ``.pth`` checkpoints.
STATE_DICT_KEY = 'state_dict'
# The keys of each rank's own state (RANK_FILE): RNG states and buffers; the random
# streams the current epoch's DataLoader iterator was created from.
RANK_STATE_KEY = 'rank_state'
ITERATOR_STREAMS_KEY = 'iterator_streams'
# per rank: a layout's other virtual ranks' random streams and buffers
VIRTUAL_RANKS_KEY = 'virtual_ranks'


def engine_tag(name: str) -> str:
    """The directory (DeepSpeed tag) engine ``name`` saves into."""
    return DS_TAG if name == SINGLE_ENGINE else f'{DS_TAG}-{name}'


def engine_modules(meta: dict[str, Any]) -> dict[str, str]:
    """``{engine name: path of its submodule in the model}`` (``''``: the model)."""
    return dict(meta.get('engines') or {SINGLE_ENGINE: ''})


def has_optimizer_state(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint holds DeepSpeed's shards (False: weights only)."""
    return bool(meta.get('optimizer_state', True))


def shard_paths(meta: dict[str, Any]) -> list[str]:
    """The checkpoint's DeepSpeed files, relative to its directory."""
    if meta.get('format_version') == 1:
        return [osp.join(DS_TAG, name) for name in meta['shards']]
    return list(meta['shards'])


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, naming the file and the fix."""


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` looks like one of our checkpoint directories."""
    return osp.isdir(path) and (osp.isfile(osp.join(path, META_FILE))
                                or bool(glob.glob(osp.join(path, f'{DS_TAG}*', ''))))


def is_complete(path: str) -> bool:
    """Whether the save of ``path`` finished on every rank."""
    return osp.isfile(osp.join(path, MARKER_FILE))


def read_meta(path: str) -> dict[str, Any]:
    """The ``meta.json`` of checkpoint ``path``."""
    meta_path = osp.join(path, META_FILE)
    if not osp.isfile(meta_path):
        raise CheckpointError(
            f'{meta_path} is missing: {path!r} is not a complete DeepSpeedRunner checkpoint.')
    with open(meta_path, encoding='utf-8') as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f'{meta_path} is not valid JSON ({e}): the checkpoint was damaged or edited. '
                'Copy it again or resume from another checkpoint.') from e
    if not isinstance(meta, dict):
        raise CheckpointError(f'{meta_path} must hold a JSON object, got {type(meta).__name__}.')
    return meta


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync'd, then renamed."""
    tmp = f'{path}.tmp{os.getpid()}'
    with open(tmp, 'w', encoding='utf-8') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_files(path: str) -> list[str]:
    """DeepSpeed's shard files of checkpoint ``path`` (every engine's), or its weights file."""
    meta = read_meta(path)
    if not has_optimizer_state(meta):
        return [osp.join(path, WEIGHTS_FILE)]
    tags = [engine_tag(name) for name in engine_modules(meta)]
    return sorted(f for tag in tags for f in glob.glob(osp.join(path, tag, '*.pt')))


def check_checkpoint(path: str) -> dict[str, Any]:
    """Refuse anything but a complete, intact checkpoint directory.

    Every file the save wrote (DeepSpeed's shards are listed in the meta at
    save time) must be present and readable as a torch zip archive.

    Args:
        path (str): The checkpoint directory.

    Returns:
        dict: Its meta.
    """
    if osp.isfile(path):
        raise CheckpointError(
            f'{path!r} is a file, but a DeepSpeedRunner checkpoint is a directory. To start '
            'from plain weights (.pth / .safetensors), use load_from without resume.')
    if not osp.isdir(path):
        raise CheckpointError(f'checkpoint {path!r} does not exist.')
    if not is_complete(path):
        raise CheckpointError(
            f'{osp.join(path, MARKER_FILE)} is missing: the save of {path!r} did not finish '
            '(a crash or kill during the save). Resume from an earlier checkpoint.')
    meta = read_meta(path)
    if meta.get('format_version') not in READABLE_FORMATS:
        raise CheckpointError(
            f'{path!r} has checkpoint format {meta.get("format_version")!r}; this version of '
            f'mmengine-deepspeed reads formats {READABLE_FORMATS}.')
    for name in shard_paths(meta):
        check_torch_file(osp.join(path, name))
    for rank in range(meta['world_size']):
        check_torch_file(osp.join(path, RANK_FILE.format(rank=rank)))
    check_torch_file(osp.join(path, CLIENT_FILE))
    return meta


def check_torch_file(path: str) -> None:
    """Refuse a missing or truncated ``torch.save`` file, naming it."""
    if not osp.isfile(path):
        raise CheckpointError(
            f'{path} is missing: the checkpoint is incomplete or was copied partly. Copy it '
            'again or resume from another checkpoint.')
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f'{path} is truncated or corrupt (not a readable torch file). Copy it again or '
            'resume from another checkpoint.')


def _step_of(path: str) -> int:
    numbers = re.findall(r'\d+', osp.basename(path))
    return int(numbers[-1]) if numbers else -1


def find_latest_complete(work_dir: str) -> tuple[Optional[str], list[str]]:
    """The newest complete checkpoint under ``work_dir``, and the incomplete ones skipped.

    ``last_checkpoint`` (written by CheckpointHook after our save returned)
    is trusted when it names a complete checkpoint; otherwise the directory
    is scanned, newest iteration first.

    Args:
        work_dir (str): The runner's work directory.

    Returns:
        tuple: The checkpoint path or None, and the incomplete directories.
    """
    candidates = [p for p in glob.glob(osp.join(work_dir, '*')) if is_checkpoint_dir(p)]
    incomplete = sorted(p for p in candidates if not is_complete(p))
    last_file = osp.join(work_dir, LAST_CHECKPOINT)
    if osp.isfile(last_file):
        with open(last_file, encoding='utf-8') as f:
            last = f.read().strip()
        if is_checkpoint_dir(last) and is_complete(last):
            return last, incomplete
    return latest_complete(work_dir), incomplete


def latest_complete(directory: str, at_most_iter: Optional[int] = None) -> Optional[str]:
    """The complete checkpoint in ``directory`` taken at the latest iteration (scanned,
    whatever ``last_checkpoint`` says), of those taken after at most ``at_most_iter``
    iterations if given; None if there is none."""
    complete = [p for p in glob.glob(osp.join(directory, '*'))
                if is_checkpoint_dir(p) and is_complete(p)]
    steps = {p: (int(read_meta(p).get('iter', -1)), _step_of(p)) for p in complete}
    if at_most_iter is not None:
        complete = [p for p in complete if steps[p][0] <= at_most_iter]
    return max(complete, key=steps.__getitem__) if complete else None
