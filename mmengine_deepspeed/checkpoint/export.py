"""Consolidated weights out of a checkpoint directory: for load_from and for export.

Built on DeepSpeed's ``zero_to_fp32`` (ZeRO 1-3: the fp32 master partitions
of every rank stitched together) and, for ZeRO-0, on the module weights the
single model-states file holds; a weights-only checkpoint holds them
consolidated already. Runs on CPU without a process group.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import os.path as osp
import pickle
import re
import sys
from collections.abc import Sequence
from typing import Any, Optional

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from ..config.resolve import DTYPES
from .layout import (
    CLIENT_FILE,
    EMA_KEY,
    MESSAGE_HUB_KEY,
    META_KEY,
    OUTSIDE_ENGINES_KEY,
    PARAM_SCHEDULERS_KEY,
    STATE_DICT_KEY,
    WEIGHTS_FILE,
    ZERO0_MODEL_FILE,
    CheckpointError,
    check_checkpoint,
    engine_modules,
    engine_tag,
    has_optimizer_state,
    shard_files,
)
from .safe_load import check_pickles, safe_load

# A tqdm bar's line (``Loading checkpoint shards: 100%|██| 2/2 [00:00<00:00, ...]``).
PROGRESS_BAR = re.compile(r'\d+/\d+ \[')


def consolidated_state_dict(path: str, allow_unsafe: bool = False) -> dict[str, torch.Tensor]:
    """The full model state dict (parameters and buffers) of checkpoint ``path``.

    A model with several engines (one per optimizer) gets each engine's
    state under its submodule's prefix, plus the parameters and buffers no
    engine holds (an EMA copy, a frozen encoder) from the client state.

    Args:
        path (str): A complete checkpoint directory.
        allow_unsafe (bool): Skip the pickle allow-list. Defaults to False.

    Returns:
        dict[str, torch.Tensor]: Keys as in ``model.state_dict()``, on CPU.
    """
    meta = check_checkpoint(path)
    check_pickles(shard_files(path), allow_unsafe)
    if not has_optimizer_state(meta):
        return dict(safe_load(osp.join(path, WEIGHTS_FILE), allow_unsafe)[STATE_DICT_KEY])
    modules = engine_modules(meta)
    state: dict[str, torch.Tensor] = {}
    for name, module_path in modules.items():
        prefix = f'{module_path}.' if module_path else ''
        for key, value in _engine_state_dict(path, engine_tag(name), meta['zero_stage'],
                                             allow_unsafe).items():
            state[prefix + key] = value
    if len(modules) > 1:
        client = safe_load(osp.join(path, CLIENT_FILE), allow_unsafe)
        state.update(client.get(OUTSIDE_ENGINES_KEY, {}))
    return state


def _engine_state_dict(path: str, tag: str, stage: int,
                       allow_unsafe: bool) -> dict[str, torch.Tensor]:
    if stage == 0:
        module = safe_load(osp.join(path, tag, ZERO0_MODEL_FILE), allow_unsafe)['module']
        return {k: v.detach().cpu() for k, v in module.items()}
    # DeepSpeed prints what it parses to stdout and its progress bars to stderr: kept out
    # of the caller's output (convert's is its one line), warnings and errors passed on
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) \
            as said:
        state = dict(get_fp32_state_dict_from_zero_checkpoint(path, tag=tag))
    for line in said.getvalue().splitlines():
        if not PROGRESS_BAR.search(line):
            print(line, file=sys.stderr)
    return state


def cast_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype, standalone: bool,
                    progress: bool = False) -> dict[str, torch.Tensor]:
    """Floating tensors to ``dtype``; integer buffers unchanged.

    DeepSpeed's consolidation returns views into one merged vector (ZeRO-1/2)
    or into padded per-parameter buffers (ZeRO-3). ``torch.save`` writes each
    storage once, so tensors already in ``dtype`` are kept as they are and an
    fp32 ``.pth`` export holds the model once in memory, not twice.
    safetensors refuses tensors that share memory: with ``standalone`` a view
    is copied into memory of its own.

    Args:
        state (dict[str, torch.Tensor]): The consolidated state dict.
        dtype (torch.dtype): The dtype floating tensors are written in.
        standalone (bool): Every tensor must own its memory (safetensors).
        progress (bool): Show a progress bar. Defaults to False.

    Returns:
        dict[str, torch.Tensor]: The tensors to write.
    """
    def convert(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        owns_memory = tensor.is_contiguous() and \
            tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        if standalone and not owns_memory:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        return tensor

    items: Any = state.items()
    if progress:
        from tqdm import tqdm
        items = tqdm(items, total=len(state), desc='convert', unit='tensor')
    return {k: convert(v) for k, v in items}


def ema_state_dict(path: str, allow_unsafe: bool = False) -> dict[str, torch.Tensor]:
    """The EMA weights (DeepSpeedEMAHook) of checkpoint ``path``, keys as the model's."""
    check_checkpoint(path)
    client = safe_load(osp.join(path, CLIENT_FILE), allow_unsafe)
    ema = client.get(EMA_KEY)
    if ema is None:
        raise CheckpointError(f'{osp.join(path, CLIENT_FILE)} holds no EMA weights: the run had '
                              'no EMAHook. Export without --ema.')
    prefix = 'module.'
    return {k[len(prefix):]: v for k, v in ema.items() if k.startswith(prefix)}


def export_checkpoint(path: str, out: str, dtype: str = 'fp32', safetensors: bool = False,
                      allow_unsafe: bool = False, progress: Optional[bool] = None,
                      ema: bool = False) -> str:
    """Write checkpoint ``path`` as one weights file MMEngine loads without DeepSpeed.

    The ``.pth`` holds ``{'meta': ..., 'state_dict': ...}`` (what
    ``mmengine.runner.load_checkpoint`` expects); the safetensors file holds
    the tensors with the meta as JSON in its metadata.

    Args:
        path (str): A complete checkpoint directory.
        out (str): The file to write.
        dtype (str): ``'fp32'``, ``'bf16'`` or ``'fp16'``. Defaults to
            ``'fp32'``.
        safetensors (bool): Write safetensors instead of a torch pickle.
            Defaults to False.
        allow_unsafe (bool): Skip the pickle allow-list. Defaults to False.
        progress (bool, optional): Show a progress bar; None shows one for
            checkpoints over 1 GiB. Defaults to None.
        ema (bool): Export the EMA weights (DeepSpeedEMAHook) instead of the
            trained ones. Defaults to False.

    Returns:
        str: ``out``.
    """
    if dtype not in DTYPES:
        raise ValueError(f'dtype={dtype!r}: choose one of {sorted(DTYPES)}.')
    if osp.isdir(out):
        raise ValueError(f'{out!r} is a directory; give the path of the file to write.')
    meta = check_checkpoint(path)
    state = (ema_state_dict(path, allow_unsafe) if ema
             else consolidated_state_dict(path, allow_unsafe))
    if progress is None:
        progress = sum(v.numel() * v.element_size() for v in state.values()) > 2**30
    state = cast_state_dict(state, DTYPES[dtype], standalone=safetensors, progress=progress)
    meta = dict(meta, exported_dtype=dtype, exported_weights='ema' if ema else 'trained')
    if safetensors:
        from safetensors.torch import save_file
        with open(out, 'wb'):  # the mode a file gets here (the umask's), as torch.save's
            pass
        mode = os.stat(out).st_mode
        save_file(state, out, metadata={'meta': json.dumps(meta, sort_keys=True)})
        os.chmod(out, mode)  # safetensors writes its files 0600
    else:
        torch.save({'meta': meta, 'state_dict': state}, out)
    return out


def describe_weights(path: str, allow_unsafe: bool = False) -> list[str]:
    """What ``inspect`` says of a weights file (``convert``'s ``.pth`` or
    ``.safetensors``, or any MMEngine checkpoint file): its meta, tensors and size.

    Args:
        path (str): The file.
        allow_unsafe (bool): Skip the pickle allow-list. Defaults to False.

    Returns:
        list[str]: The lines to print.
    """
    if path.endswith('.safetensors'):
        from safetensors import safe_open

        with safe_open(path, framework='pt') as f:
            meta = json.loads((f.metadata() or {}).get('meta', '{}'))
            state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118  no mapping
        kind, loader = 'safetensors weights file', 'safetensors.torch.load_file'
    else:
        loaded = safe_load(path, allow_unsafe)
        if not isinstance(loaded, dict):
            raise CheckpointError(f'{path} holds a {type(loaded).__name__}, not a checkpoint.')
        state = loaded.get(STATE_DICT_KEY, loaded)
        meta = loaded.get(META_KEY) or {}
        others = sorted(set(loaded) - {STATE_DICT_KEY, META_KEY}) if STATE_DICT_KEY in loaded \
            else []
        kind = 'weights file (torch pickle' + (f'; also {", ".join(others)})' if others else ')')
        loader = 'mmengine.runner.load_checkpoint or load_from'
    shapes = {key: (list(value.shape), str(value.dtype).replace('torch.', ''))
              for key, value in state.items() if isinstance(value, torch.Tensor)}
    elements = sum(math.prod(shape) for shape, _ in shapes.values())
    dtypes = sorted({dtype for _, dtype in shapes.values()})
    lines = [f'weights file: {path}', f'kind: {kind}; not a checkpoint directory (no optimizer '
             f'state, no resume): load it with {loader}']
    for key in ('epoch', 'iter', 'exported_dtype', 'exported_weights', 'zero_stage'):
        if key in meta:
            lines.append(f'{key}: {meta[key]}')
    lines.append(f'tensors: {len(shapes)} ({elements:,} elements; {", ".join(dtypes)})')
    lines.append(f'size: {osp.getsize(path) / 2**20:.2f} MiB')
    return lines


def publish_checkpoint(path: str, keys: Sequence[str], allow_unsafe: bool = False
                       ) -> tuple[str, list[str]]:
    """CheckpointHook's ``published_keys``: checkpoint ``path`` as MMEngine publishes one.

    One file next to the directory, named as MMEngine names it
    (``<name>-<sha256[:8]>.pth``, the hash of its pickled content), holding
    the requested keys of an MMEngine checkpoint: ``meta``, ``state_dict``
    (the consolidated fp32 weights), ``message_hub``, ``param_schedulers``.
    The optimizer state is DeepSpeed's partitions and is not published.

    Args:
        path (str): A complete checkpoint directory.
        keys (Sequence[str]): ``published_keys``.
        allow_unsafe (bool): Skip the pickle allow-list. Defaults to False.

    Returns:
        tuple[str, list[str]]: The file written, and the requested keys it
        cannot hold.
    """
    meta = check_checkpoint(path)
    client = safe_load(osp.join(path, CLIENT_FILE), allow_unsafe)
    available = {META_KEY: dict(client.get(META_KEY, {}), **meta),
                 STATE_DICT_KEY: lambda: consolidated_state_dict(path, allow_unsafe),
                 MESSAGE_HUB_KEY: client.get(MESSAGE_HUB_KEY),
                 PARAM_SCHEDULERS_KEY: client.get(PARAM_SCHEDULERS_KEY)}
    published = {key: value() if callable(value) else value
                 for key, value in available.items() if key in keys and value is not None}
    sha = hashlib.sha256(pickle.dumps(published)).hexdigest()
    out = osp.splitext(path.rstrip(os.sep))[0] + f'-{sha[:8]}.pth'
    torch.save(published, out)
    return out, [key for key in keys if key not in published]
