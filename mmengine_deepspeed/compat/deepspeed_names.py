"""The DeepSpeed names of :mod:`mmengine_deepspeed.compat` (see its docstring)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


def backward_prologue(engine: Any) -> None:
    """DeepSpeed's per-backward bookkeeping, for a backward the engine did not start.

    ``engine.backward`` runs it only for losses of the engine's own forward;
    no public API runs it otherwise (see :data:`PRIVATE_NAMES`).
    """
    engine._backward_prologue()


def end_interrupted_backward(optimizer: Any) -> None:
    """Leave the backward that a ZeRO optimizer entered and an error interrupted.

    ``engine.backward`` enters the optimizer's backward and leaves it only when the backward
    completes (``_backward_active_depth``, no public reader), so an error inside one (an
    out-of-memory error that ``engine/split_retry.py`` retries) would leave every later
    backward a level deeper. Pinned by tests/dist/test_layout.py's out-of-memory cases.
    """
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(optimizer, ZeROOptimizer):
        while optimizer._backward_active_depth > 0:
            optimizer.exit_backward()


def release_process_group_references() -> None:
    """Drop DeepSpeed's cached process groups of a destroyed world.

    DeepSpeed's own ``destroy_process_group`` calls it; after torch's
    ``destroy_process_group()`` nothing public does.
    """
    from deepspeed.utils import groups
    groups._release_process_group_references(group=None)


def mark_op_unavailable(name: str) -> None:
    """Make DeepSpeed treat its op ``name`` as one this machine cannot build.

    DeepSpeed builds an op only where ``deepspeed.ops.__compatible_ops__`` (probed
    once per process, then kept: DeepSpeed's comment says edits persist) says it
    can; no public switch turns a JIT build off. Pinned by tests/unit/test_compat.py.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[name] = False


def release_module_params(engine: Any, module: nn.Module) -> None:
    """Wait for ``module``'s ZeRO-3 parameters in flight and release them all.

    A ZeRO-3 engine prefetches the parameters its recorded trace will need
    next; those of a module the model updates itself between two forwards
    may be in flight then, which ``GatheredParameters`` neither waits for nor
    can release ("Cannot partition a param in flight"). DeepSpeed's coordinator
    does both, for any module (``engine.empty_partition_cache`` does it for the
    whole model, which would also release a module still running); no public
    API reaches it. It takes the modules DeepSpeed registered (those with
    ``ds_external_parameters``): a container built on the fly (BYOL's
    ``nn.Sequential(backbone, neck)``) is reached through its children.
    Pinned by tests/dist/test_in_step.py.
    """
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    pending = [module]
    while pending:
        current = pending.pop()
        if hasattr(current, 'ds_external_parameters'):
            coordinator.release_and_reset_all(current)
        else:
            pending.extend(current.children())


def gather_whole(params: list[nn.Parameter]) -> None:
    """Make released ZeRO-3 parameters whole on every rank (one collective gather).

    ``GatheredParameters`` pairs this with a re-partition that either drops what the
    block wrote or broadcasts one rank's values; a block that every rank computes
    alike (an averaged model's update from whole inputs) needs neither, so it uses
    DeepSpeed's own per-parameter ``all_gather`` / ``partition`` (what
    ``GatheredParameters`` calls). Pinned by tests/dist/test_in_step.py.
    """
    if params:
        params[0].all_gather(param_list=params)  # type: ignore[attr-defined]


def keep_local_slices(params: list[nn.Parameter]) -> None:
    """Re-partition whole ZeRO-3 parameters that every rank updated alike: each rank
    keeps its own slice of its values (``partition(has_been_updated=True)``; no
    collective). See :func:`gather_whole`."""
    if params:
        params[0].partition(param_list=params,  # type: ignore[attr-defined]
                            has_been_updated=True)


def clipped_global_grad_norm(engine: Any) -> torch.Tensor:
    """The norm of all gradients of the step being taken, after DeepSpeed's clipping.

    DeepSpeed's ZeRO and bf16 optimizers store the norm in ``_global_grad_norm``
    before they step the first param group (the engine's public
    ``get_global_grad_norm`` has it only after the step), then scale the gradients by
    ``min(1, clip / (norm + 1e-6))``. LAMB's own clip reads the clipped norm. Pinned by
    tests/dist/test_norm_optimizers.py (LAMB with clip_grad at every stage).
    """
    norm = torch.as_tensor(engine.optimizer._global_grad_norm, dtype=torch.float64)
    clip = float(engine.gradient_clipping() or 0.0)
    if clip > 0:
        norm = norm * torch.clamp(clip / (norm + 1e-6), max=1.0)
    return norm


# ZeRO-3 parameter attributes. DeepSpeed documents ``ds_shape`` / ``ds_numel`` /
# ``ds_tensor`` on partitioned parameters but offers no accessor functions.

def is_zero3_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 (``zero.Init`` or engine) parameter."""
    return hasattr(param, 'ds_id')


def full_numel(param: torch.Tensor) -> int:
    """The whole parameter's number of elements (a partitioned one holds fewer)."""
    return int(getattr(param, 'ds_numel', param.numel()))


def full_shape(param: torch.Tensor) -> torch.Size:
    """The whole parameter's shape (a partitioned one is empty until gathered)."""
    return torch.Size(getattr(param, 'ds_shape', param.shape))


def set_full_shape(param: torch.Tensor, shape: torch.Size) -> None:
    """Set the shape ZeRO-3 restores on gather (no public setter; 0-dim parameters)."""
    param.ds_shape = shape  # type: ignore[attr-defined]


def local_partition(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's ZeRO-3 partition of ``param`` (None for a whole parameter)."""
    return getattr(param, 'ds_tensor', None)


def is_released(param: Any) -> bool:
    """Whether a ZeRO-3 parameter is released (only its partition held): ``ds_status``."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(param, 'ds_status', None) == ZeroParamStatus.NOT_AVAILABLE


def partition_group(param: torch.Tensor) -> Any:
    """The process group a ZeRO-3 parameter is partitioned over (``ds_process_group``;
    None for the default group)."""
    return getattr(param, 'ds_process_group', None)


# DeepSpeed's engine skips its initial broadcast for parameters with this attribute (its
# ``_broadcast_model`` tests it); 0-dim parameters are broadcast by us instead
# (tests/dist/test_partitioned.py).
SKIP_BROADCAST_MARK = 'ds_optim_param'


def skip_engine_broadcast(param: torch.Tensor, skip: bool) -> None:
    """Mark (or unmark) ``param`` for DeepSpeed's engine not to broadcast it at build."""
    if skip:
        setattr(param, SKIP_BROADCAST_MARK, True)
    elif hasattr(param, SKIP_BROADCAST_MARK):
        delattr(param, SKIP_BROADCAST_MARK)


def has_separate_master(param: torch.Tensor) -> bool:
    """Whether DeepSpeed keeps an fp32 master of ``param`` apart from it.

    ZeRO-3 marks its parameters with ``_z3_optimizer`` and ZeRO-1/2 with
    ``_hp_mapping``, which ``deepspeed.utils.safe_get_full_fp32_param``
    itself checks (tests/unit/test_checkpoint_weights.py).
    """
    return hasattr(param, '_z3_optimizer') or hasattr(param, '_hp_mapping')
