"""Resume on another world size or ZeRO stage through DeepSpeed universal checkpoints.

A ZeRO-1/2/3 checkpoint holds each rank's partition of the fp32 weights and
optimizer states; another world size or stage partitions them differently.
DeepSpeed's ``ds_to_universal`` rewrites them per parameter (independent of
the layout), and an engine built with ``checkpoint.load_universal`` loads
that into its own layout. The conversion runs once, on rank 0, and is cached
beside the checkpoint (``deepspeed_universal/``, one per engine's tag). ZeRO-0 checkpoints hold the
whole state in one file and load on any world size as they are; so do
weights-only ones (``weights.py``), on any stage too.
"""
from __future__ import annotations

import glob
import os
import os.path as osp
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from typing_extensions import override

from .layout import ZERO0_MODEL_FILE, ZERO3_MODEL_FILE, CheckpointError, write_text_atomic
from .safe_load import safe_load

ADAM_STATE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam)
UNIVERSAL_MARKER = 'CONVERTED'


@dataclass(frozen=True)
class Sharding:
    """How a run partitions its state."""

    world_size: int
    zero_stage: int

    @override
    def __str__(self) -> str:
        return f'world size {self.world_size}, ZeRO-{self.zero_stage}'


def needs_universal(saved: Sharding, current: Sharding, path: str) -> bool:
    """Whether resuming ``path`` (saved as ``saved``) needs a universal checkpoint.

    Raises before any state is touched when the change cannot be supported.

    Args:
        saved (Sharding): The checkpoint's layout (from its meta).
        current (Sharding): This run's layout.
        path (str): The checkpoint, for messages.

    Returns:
        bool: True for a ZeRO-1/2/3 checkpoint loaded into another layout.
    """
    if saved == current:
        return False
    if saved.zero_stage == 0 and current.zero_stage == 0:
        return False  # one full state file, valid for any world size
    if saved.zero_stage == 0 or current.zero_stage == 0:
        raise CheckpointError(
            f'{path!r} was saved with {saved}; this run has {current}. Changing between ZeRO-0 '
            'and ZeRO-1/2/3 on resume is not supported (DeepSpeed universal checkpoints need '
            'ZeRO partitions on both sides). Resume with zero_optimization.stage='
            f'{saved.zero_stage}, or start from its weights with load_from and resume=False.')
    if saved.zero_stage == 3 and current.zero_stage < 3:
        raise CheckpointError(
            f'{path!r} was saved with {saved}; this run has {current}. DeepSpeed 0.19 cannot '
            'load a ZeRO-3 universal checkpoint into ZeRO-1/2. Resume with ZeRO-3 (on any world '
            'size), or start from its weights with load_from and resume=False.')
    return True


# The engine-level state file a universal checkpoint carries is named after
# the stage it was saved from; a loading engine looks for its own stage's name
# (ZeRO-3: per-rank files, read as rank 0's under universal loading).
STATE_FILE = {True: ZERO3_MODEL_FILE, False: ZERO0_MODEL_FILE}


def check_reshardable(optimizer: Any, path: str) -> None:
    """Refuse optimizers whose state a universal checkpoint cannot carry.

    DeepSpeed 0.19's ``ds_to_universal`` converts Adam-style states
    (``exp_avg``, ``exp_avg_sq``) only; SGD's momentum or others fail inside
    it with a bare ``KeyError``.

    Args:
        optimizer (Any): The optimizer of the resuming run.
        path (str): The checkpoint, for messages.
    """
    if not isinstance(optimizer, ADAM_STATE_OPTIMIZERS):
        raise CheckpointError(
            f'Resuming {path!r} on another world size or ZeRO stage needs a DeepSpeed universal '
            'checkpoint, which carries Adam-style optimizer states only (Adam, AdamW, FusedAdam, '
            f'DeepSpeedCPUAdam); {type(optimizer).__name__} cannot be resharded. Resume with the '
            'saved world size and stage, or start from its weights with load_from and '
            'resume=False (the optimizer state restarts).')


def universal_tag(tag: str) -> str:
    """The tag of the universal checkpoint made from the engine saved under ``tag``."""
    return f'{tag}_universal'


def convert(path: str, tag: str, target_stage: int) -> str:
    """Make (once, cached) the universal checkpoint of one engine of ``path``; collective.

    Rank 0 converts while the others wait; every rank returns the tag to load.

    Args:
        path (str): A complete checkpoint directory.
        tag (str): The engine's tag in it.
        target_stage (int): The ZeRO stage of the engine that will load it.

    Returns:
        str: The tag of the universal checkpoint inside ``path``.
    """
    out = osp.join(path, universal_tag(tag))
    if dist.get_rank() == 0:
        if not osp.isfile(osp.join(out, UNIVERSAL_MARKER)):
            shutil.rmtree(out, ignore_errors=True)
            _run_ds_to_universal(osp.join(path, tag), out)
            write_text_atomic(osp.join(out, UNIVERSAL_MARKER), 'converted\n')
        _adapt_across_stages(out, target_stage)
    dist.barrier()
    return universal_tag(tag)


def _adapt_across_stages(out: str, target_stage: int) -> None:
    """Let a ZeRO-3 engine load a ZeRO-1/2 universal checkpoint.

    DeepSpeed 0.19's ``ds_to_universal`` writes the per-parameter files
    (``zero/<name>/fp32.pt``, ``exp_avg.pt``, ...) the same for every stage,
    but the files around them follow the source stage: the engine state file
    name and, for the ZeRO-3 loader, the optimizer ``step`` and
    ``param_groups`` under ``optimizer_state_dict`` in
    ``zero/optimizer_state.pt``. This fills in what the ZeRO-3 loader reads
    from what a ZeRO-1/2 source wrote; tests/dist/test_reshard.py pins it.
    """
    wanted = osp.join(out, STATE_FILE[target_stage == 3])
    other = osp.join(out, STATE_FILE[target_stage != 3])
    if not osp.isfile(wanted) and osp.isfile(other):
        shutil.copyfile(other, wanted)
    zero_dir = osp.join(out, 'zero')
    optim_path = osp.join(zero_dir, 'optimizer_state.pt')
    optim = safe_load(optim_path)
    param_dirs = [d for d in glob.glob(osp.join(zero_dir, '*')) if osp.isdir(d)]
    steps = [p for p in (osp.join(d, 'step.pt') for d in param_dirs) if osp.isfile(p)]
    if target_stage == 3 and OPTIMIZER_STATE_DICT not in optim and steps:
        step = safe_load(steps[0])
        optim[OPTIMIZER_STATE_DICT] = {'state': {0: {'step': step}},
                                       'param_groups': optim['param_groups']}
        torch.save(optim, optim_path)


def _run_ds_to_universal(input_folder: str, output_folder: str) -> None:
    # DeepSpeed's own command, in a fresh process: its worker pool forks, and
    # forking a training process (gloo / NCCL threads) can deadlock. No state
    # injection: our saves record universal_checkpoint_info.
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    cmd = [sys.executable, '-m', 'deepspeed.checkpoint.ds_to_universal',
           '--input_folder', input_folder, '--output_folder', output_folder,
           '--num_extract_workers', workers, '--num_merge_workers', '1']
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CheckpointError(
            f'DeepSpeed could not convert {input_folder} to a universal checkpoint '
            f'({" ".join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}')
