"""Activation checkpointing through DeepSpeed when ds_config has a section for it.

MMEngine's ``activation_checkpointing = ['backbone.layer1', ...]`` key wraps
those modules' ``forward`` in torch's ``checkpoint``, and DeepSpeed leaves
its own section unused unless the model calls
``deepspeed.checkpointing.checkpoint`` (Megatron-style) after
``deepspeed.checkpointing.configure``. With the section present, the runner
configures DeepSpeed's checkpointing from the resolved ds_config
(``partition_activations``, ``cpu_checkpointing``,
``contiguous_memory_optimization``, ``number_checkpoints``,
``synchronize_checkpoint_boundary``, ``profile``) and routes the listed
modules through DeepSpeed's ``checkpoint`` instead of torch's, so the
section does what DeepSpeed documents.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import deepspeed
import torch
from torch import nn

SECTION = 'activation_checkpointing'


def has_section(ds_config: dict) -> bool:
    """Whether ``ds_config`` configures DeepSpeed's activation checkpointing."""
    return isinstance(ds_config.get(SECTION), dict)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # validation: nothing to recompute
            return forward(*args, **kwargs)
        return deepspeed.checkpointing.checkpoint(forward, *args, **kwargs)

    return wrapper


def checkpointed_modules(model: nn.Module, modules: Any) -> list[tuple[str, nn.Module]]:
    """The submodules MMEngine's ``activation_checkpointing`` key names, by name.

    Read before training starts (the runner's ``train()``, ``plan``), so that a name
    the model lacks is refused naming the key and the fix, not by torch's
    ``AttributeError`` from inside MMEngine's ``turn_on_activation_checkpointing``.

    Args:
        model (nn.Module): The bare model.
        modules (Any): The key's value: a dotted submodule name, a list of them, or None.

    Raises:
        ValueError: A value that is not names, or a name that is not a submodule.
    """
    if modules is None:
        return []
    names = [modules] if isinstance(modules, str) else modules
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f'{SECTION}={modules!r}: give a list of dotted submodule names '
                         "of the model (e.g. ['backbone.layer1']).")
    found = []
    for name in names:
        try:
            found.append((name, model.get_submodule(name)))
        except AttributeError as e:
            raise ValueError(
                f'{SECTION} names {name!r}, which is not a submodule of '
                f'{type(model).__name__} ({e}); use dotted names from model.named_modules() '
                f'(e.g. {_examples(model)}).') from e
    return found


def _examples(model: nn.Module) -> str:
    """A few of the model's top-level submodule names, for an error message."""
    names = [name for name, _ in model.named_children()][:4]
    return ', '.join(repr(n) for n in names) or 'the model has no submodules'


def checkpoint_through_deepspeed(model: nn.Module, modules: Any,
                                 ds_config: dict) -> list[str]:
    """Configure DeepSpeed's checkpointing and wrap ``modules`` of ``model`` with it.

    Args:
        model (nn.Module): The bare model.
        modules (Any): MMEngine's ``activation_checkpointing`` value: dotted submodule
            names (may be empty; :func:`checkpointed_modules`).
        ds_config (dict): The resolved ds_config, with the section.

    Returns:
        list[str]: The modules wrapped.
    """
    if not deepspeed.comm.is_initialized():  # configure() asks DeepSpeed's comm for the
        # rank; deepspeed.initialize sets it up later, zero.Init (ZeRO-3) before this
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
    found = checkpointed_modules(model, modules)
    for _, module in found:
        module.forward = _checkpointed(module.forward)
    return [name for name, _ in found]
