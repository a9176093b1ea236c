"""The ds_config: load it, fill ``"auto"`` from the MMEngine side, validate it.

MMEngine owns the optimizer, the schedulers, the batch size, gradient
accumulation and clipping; DeepSpeed owns partitioning, precision and
communication. The two configs overlap on a few keys, and this module is the
one place that reconciles them: an ``"auto"`` (or absent) value is filled from
the MMEngine config, an explicit value that disagrees is refused with a message
naming both keys, and settings DeepSpeed would silently misread are refused
before any process group or engine exists.
"""
from __future__ import annotations

import copy
import json
import os.path as osp
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .checks import (
    AUTO,
    DsConfigError,
    check_keys,
    check_precision,
    check_types,
    enabled,
    get_value,
)

DsConfigSource = Union[str, Mapping[str, Any], None]

# Optim wrappers that do their own mixed precision; DeepSpeed does it instead.
AMP_WRAPPERS = ('AmpOptimWrapper', 'ApexOptimWrapper')
PLAIN_WRAPPERS = ('OptimWrapper', 'DeepSpeedOptimWrapper')


@dataclass(frozen=True)
class MMEngineSettings:
    """The parts of an MMEngine config that overlap with a ds_config.

    Args:
        batch_size (int, optional): ``train_dataloader.batch_size``; None
            when the runner has no training dataloader. Defaults to None.
        accumulative_counts (int, optional):
            ``optim_wrapper.accumulative_counts`` if set. Defaults to None.
        clip_grad (dict, optional): ``optim_wrapper.clip_grad``.
            Defaults to None.
        optim_wrapper_type (str, optional): ``optim_wrapper.type``.
            Defaults to None.
        has_optim_wrapper (bool): Whether MMEngine defines an optimizer.
            Defaults to False.
        has_param_scheduler (bool): Whether MMEngine defines
            ``param_scheduler``. Defaults to False.
    """

    batch_size: Optional[int] = None
    accumulative_counts: Optional[int] = None
    clip_grad: Optional[Mapping[str, Any]] = None
    optim_wrapper_type: Optional[str] = None
    has_optim_wrapper: bool = False
    has_param_scheduler: bool = False


def load_ds_config(source: DsConfigSource, config_dir: Optional[str] = None) -> dict:
    """Return a private deep copy of the user's ds_config.

    Args:
        source (str | Mapping | None): A dict (an MMEngine ``ConfigDict``
            included), the path of a JSON file, or None for DeepSpeed's
            defaults (ZeRO-0, fp32).
        config_dir (str, optional): Directory of the MMEngine config file; a
            relative JSON path is looked up there when it is not found from
            the working directory. Defaults to None.

    Returns:
        dict: A plain dict the caller may modify.
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return _to_plain(source)
    if not isinstance(source, str):
        raise DsConfigError(
            f'ds_config must be a dict or the path of a JSON file, got {type(source).__name__}.')
    candidates = [source]
    if config_dir is not None and not osp.isabs(source):
        candidates.append(osp.join(config_dir, source))
    for path in candidates:
        if osp.isdir(path):
            raise DsConfigError(f'ds_config {path!r} is a directory; pass the path of a JSON file.')
        if osp.isfile(path):
            with open(path, encoding='utf-8') as f:
                try:
                    loaded = json.load(f)
                except json.JSONDecodeError as e:
                    raise DsConfigError(f'ds_config file {path!r} is not valid JSON: {e}') from e
            if not isinstance(loaded, dict):
                raise DsConfigError(f'ds_config file {path!r} must hold a JSON object.')
            return loaded
    raise DsConfigError(
        f'ds_config file not found: tried {", ".join(repr(p) for p in candidates)}. '
        'Give a path relative to the working directory or to the config file.')


def _to_plain(value: Any) -> Any:
    """Deep-copy mappings (ConfigDict included) and sequences into plain types."""
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return copy.deepcopy(value)


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage of a validated config (0 when unset)."""
    return int(get_value(ds_config, 'zero_optimization.stage', 0))


# The torch dtype of each precision name (ds_config's and ``convert --dtype``'s).
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}


def precision(ds_config: Mapping[str, Any]) -> str:
    """``'bf16'``, ``'fp16'`` or ``'fp32'`` for a validated config."""
    if enabled(ds_config, 'bf16') or enabled(ds_config, 'bfloat16'):
        return 'bf16'
    if enabled(ds_config, 'fp16'):
        return 'fp16'
    return 'fp32'


def resolve_ds_config(
    source: DsConfigSource,
    side: MMEngineSettings,
    *,
    world_size: Optional[int],
    cuda_available: bool,
    config_dir: Optional[str] = None,
    native_bf16: bool = True,
) -> dict:
    """Load, validate and fill a ds_config against the MMEngine config.

    Called once before the runner touches any process (with
    ``world_size=None``, so that ``train_batch_size`` is not checked yet) and
    again right before ``deepspeed.initialize`` with the real world size.

    Args:
        source (str | Mapping | None): See :func:`load_ds_config`.
        side (MMEngineSettings): What the MMEngine config says.
        world_size (int, optional): Data-parallel world size, or None if
            not known yet.
        cuda_available (bool): Whether this process can use CUDA.
        config_dir (str, optional): See :func:`load_ds_config`.
            Defaults to None.
        native_bf16 (bool): Whether this machine computes bf16 natively;
            ``bf16.enabled="auto"`` becomes this. Defaults to True.

    Returns:
        dict: The config to hand to ``deepspeed.initialize``.
    """
    ds = load_ds_config(source, config_dir)
    check_keys(ds)
    check_types(ds)
    for section in ('bf16', 'bfloat16'):
        if get_value(ds, f'{section}.enabled') == AUTO:
            ds[section]['enabled'] = native_bf16
    check_precision(ds, cuda_available)
    _check_optim_wrapper(side)
    _check_ownership(ds, side)
    _fill_batch(ds, side, world_size)
    _fill_clipping(ds, side)
    # DeepSpeed logs a progress line every `steps_per_print` steps by default,
    # duplicating LoggerHook; None switches it off (the engine tests for None).
    ds.setdefault('steps_per_print', None)
    # DeepSpeed's throughput timer synchronizes the device at every forward() and step() of
    # an engine given no dataloader (always, under MMEngine's loops), to time steps that
    # ThroughputHook already times without waiting: off unless the ds_config asks for timers.
    if 'timers' not in ds and not ds.get('wall_clock_breakdown'):
        ds['timers'] = {'throughput': {'enabled': False}}
    return ds


def bf16_request(source: DsConfigSource, config_dir: Optional[str] = None) -> Any:
    """What the user's ds_config says for ``bf16.enabled``: True, False, ``"auto"`` or None."""
    ds = load_ds_config(source, config_dir)
    value = get_value(ds, 'bf16.enabled')
    return get_value(ds, 'bfloat16.enabled') if value is None else value


def _check_optim_wrapper(side: MMEngineSettings) -> None:
    wrapper_type = side.optim_wrapper_type
    if wrapper_type in AMP_WRAPPERS:
        raise DsConfigError(
            f'optim_wrapper.type={wrapper_type!r} does its own mixed precision, which '
            'DeepSpeed replaces: set optim_wrapper.type="OptimWrapper" and enable '
            'bf16=dict(enabled=True) (or fp16 on CUDA) in ds_config.')
    if wrapper_type is not None and wrapper_type not in PLAIN_WRAPPERS:
        raise DsConfigError(
            f'optim_wrapper.type={wrapper_type!r} is not supported with DeepSpeed; use '
            f'one of {PLAIN_WRAPPERS}.')
    clip = side.clip_grad
    if clip is None:
        return
    clip_type = clip.get('type', 'norm')
    if clip_type != 'norm':
        raise DsConfigError(
            f'optim_wrapper.clip_grad.type={clip_type!r}: DeepSpeed clips gradients by '
            'global norm only; use clip_grad=dict(max_norm=...).')
    norm_type = clip.get('norm_type', 2)
    if float(norm_type) != 2.0:
        raise DsConfigError(
            f'optim_wrapper.clip_grad.norm_type={norm_type!r}: DeepSpeed clips by the L2 '
            'norm only; remove norm_type or set it to 2.')
    unknown = set(clip) - {'type', 'max_norm', 'norm_type'}
    if unknown:
        raise DsConfigError(
            f'optim_wrapper.clip_grad has {sorted(unknown)}, which DeepSpeed cannot honour; '
            'keep only max_norm (and norm_type=2).')
    max_norm = clip.get('max_norm')
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm <= 0:
        raise DsConfigError(
            f'optim_wrapper.clip_grad.max_norm must be a positive number, got {max_norm!r}.')


def _check_ownership(ds: Mapping[str, Any], side: MMEngineSettings) -> None:
    if 'optimizer' in ds and side.has_optim_wrapper:
        raise DsConfigError(
            'ds_config.optimizer conflicts with optim_wrapper.optimizer: MMEngine builds the '
            'optimizer (paramwise_cfg and constructors included). Remove "optimizer" from '
            'ds_config and configure optim_wrapper.optimizer instead.')
    if 'scheduler' in ds and side.has_param_scheduler:
        raise DsConfigError(
            'ds_config.scheduler conflicts with param_scheduler: MMEngine schedules the '
            'learning rate. Remove "scheduler" from ds_config.')


def _fill_batch(ds: dict, side: MMEngineSettings, world_size: Optional[int]) -> None:
    micro = _reconcile(ds, 'train_micro_batch_size_per_gpu', side.batch_size,
                       'train_dataloader.batch_size', default=1)
    accum = _reconcile(ds, 'gradient_accumulation_steps', side.accumulative_counts,
                       'optim_wrapper.accumulative_counts', default=1)
    if world_size is None:
        return
    derived = micro * accum * world_size
    explicit = ds.get('train_batch_size', AUTO)
    if explicit != AUTO and explicit != derived:
        raise DsConfigError(
            f'ds_config.train_batch_size={explicit} disagrees with train_dataloader.batch_size '
            f'({micro}) x optim_wrapper.accumulative_counts ({accum}) x world size '
            f'({world_size}) = {derived}; set it to "auto" or remove it.')
    ds['train_batch_size'] = derived


def _reconcile(ds: dict, key: str, mm_value: Optional[int], mm_key: str, default: int) -> int:
    """Fill ``ds[key]`` from MMEngine, or refuse when both are set and differ."""
    value = ds.get(key, AUTO)
    if value == AUTO:
        value = default if mm_value is None else mm_value
    elif mm_value is not None and value != mm_value:
        raise DsConfigError(
            f'ds_config.{key}={value} disagrees with {mm_key}={mm_value}; set one of them '
            f'(ds_config.{key}="auto" takes the MMEngine value).')
    ds[key] = value
    return int(value)


def _fill_clipping(ds: dict, side: MMEngineSettings) -> None:
    max_norm = None if side.clip_grad is None else float(side.clip_grad['max_norm'])
    value = ds.get('gradient_clipping', AUTO)
    if value == AUTO:
        ds['gradient_clipping'] = 0.0 if max_norm is None else max_norm
    elif max_norm is not None and float(value) != max_norm:
        raise DsConfigError(
            f'ds_config.gradient_clipping={value} disagrees with '
            f'optim_wrapper.clip_grad.max_norm={max_norm}; set one of them.')
