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
from collections.abc import Callable, Sequence
from typing import Any, Union

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


def checkpoint_through_deepspeed(model: nn.Module, modules: Union[str, Sequence[str]],
                                 ds_config: dict) -> list[str]:
    """Configure DeepSpeed's checkpointing and wrap ``modules`` of ``model`` with it.

    Args:
        model (nn.Module): The bare model.
        modules (str | Sequence[str]): MMEngine's ``activation_checkpointing``
            value: dotted submodule names (may be empty).
        ds_config (dict): The resolved ds_config, with the section.

    Returns:
        list[str]: The modules wrapped.

    Raises:
        ValueError: A name that is not a submodule of the model.
    """
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
    names = [modules] if isinstance(modules, str) else list(modules)
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError as e:
            raise ValueError(
                f'activation_checkpointing names {name!r}, which is not a submodule of '
                f'{type(model).__name__} ({e}); use dotted names from model.named_modules().'
            ) from e
        module.forward = _checkpointed(module.forward)
    return names
