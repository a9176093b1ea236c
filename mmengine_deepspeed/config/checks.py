"""The ds_config on its own: dotted lookups, the keys DeepSpeed knows, where ``"auto"``
may stand, value types and precision.

These checks need nothing from the MMEngine config; ``config/resolve.py`` runs them
first, then reconciles the ds_config with the MMEngine side.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Optional

AUTO = 'auto'

# Top-level keys DeepSpeed 0.19 understands. Anything else is almost always a
# typo that DeepSpeed would ignore without a word.
KNOWN_TOP_LEVEL_KEYS = (
    'activation_checkpointing', 'aio', 'amp', 'autotuning', 'bf16', 'bfloat16',
    'checkpoint', 'comet', 'comms_logger', 'communication_data_type', 'compile',
    'compression_training', 'csv_monitor', 'curriculum_learning', 'data_efficiency',
    'data_types', 'dataloader_drop_last', 'disable_allgather', 'disable_python_gc',
    'dump_state', 'eigenvalue', 'elasticity', 'expert_parallel', 'flops_profiler',
    'fp16', 'gradient_accumulation_steps', 'gradient_allreduce_op', 'gradient_clipping',
    'gradient_predivide_factor', 'graph_harvesting', 'hybrid_engine',
    'load_universal_checkpoint', 'log_level', 'managed_gradient_accumulation',
    'memory_breakdown', 'monitor_config', 'nebula', 'optimizer', 'pipeline',
    'prescale_gradients', 'progressive_layer_drop', 'scheduler',
    'seq_parallel_communication_data_type', 'sparse_attention', 'sparse_gradients',
    'steps_per_print', 'tensorboard', 'timers', 'torch_autocast', 'train_batch_size',
    'train_micro_batch_size_per_gpu', 'use_data_before_expert_parallel_', 'wall_clock_breakdown',
    'wandb', 'weight_quantization', 'zero_allow_untested_optimizer',
    'zero_force_ds_cpu_optimizer', 'zero_optimization',
)

# Keys whose value we may fill; "auto" anywhere else is refused. bf16 "auto"
# means bf16 where the hardware computes it natively, fp32 elsewhere.
FILLED_KEYS = ('train_micro_batch_size_per_gpu', 'gradient_accumulation_steps',
               'gradient_clipping', 'train_batch_size', 'bf16.enabled', 'bfloat16.enabled')

OFFLOAD_DEVICES = ('cpu', 'nvme', 'none')


class DsConfigError(ValueError):
    """A ds_config that cannot be used, with the key at fault and the fix."""


def get_value(ds_config: Mapping[str, Any], dotted_key: str, default: Any = None) -> Any:
    """Look up ``'zero_optimization.stage'``-style keys.

    Args:
        ds_config (Mapping): The config.
        dotted_key (str): Keys joined by dots.
        default (Any): Returned when a key on the way is missing.
            Defaults to None.

    Returns:
        Any: The value found, or ``default``.
    """
    node: Any = ds_config
    for part in dotted_key.split('.'):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def enabled(ds_config: Mapping[str, Any], section: str) -> bool:
    """Whether ``section.enabled`` (``bf16``, ``fp16``...) is set."""
    return bool(get_value(ds_config, f'{section}.enabled', False))


def check_keys(ds: Mapping[str, Any]) -> None:
    """Refuse unknown top-level keys, "auto" where nothing fills it, and ``pipeline``."""
    for key in ds:
        if key not in KNOWN_TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(key, KNOWN_TOP_LEVEL_KEYS, n=1, cutoff=0.6)
            hint = f' Did you mean {close[0]!r}?' if close else ''
            raise DsConfigError(f'ds_config has an unknown key {key!r}.{hint}')
    for key, value in _walk(ds):
        if value == AUTO and key not in FILLED_KEYS:
            raise DsConfigError(
                f'ds_config.{key} is "auto", but only {", ".join(FILLED_KEYS)} can be '
                'filled from the MMEngine config; give an explicit value.')
    if get_value(ds, 'pipeline') not in (None, {}):
        raise DsConfigError(
            'ds_config.pipeline: pipeline parallelism is not supported by DeepSpeedRunner yet; '
            'remove the "pipeline" section (data parallelism with ZeRO 0-3 is).')


def _walk(node: Mapping[str, Any], prefix: str = '') -> list[tuple[str, Any]]:
    items = []
    for key, value in node.items():
        dotted = f'{prefix}{key}'
        if isinstance(value, Mapping):
            items.extend(_walk(value, dotted + '.'))
        else:
            items.append((dotted, value))
    return items


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(ds: Mapping[str, Any], key: str, ok: bool, what: str) -> None:
    if not ok:
        value = get_value(ds, key)
        raise DsConfigError(f'ds_config.{key} must be {what}, got {value!r}.')


def check_types(ds: Mapping[str, Any]) -> None:
    """Refuse values of the wrong type or range, naming the key."""
    for key in ('train_micro_batch_size_per_gpu', 'gradient_accumulation_steps',
                'train_batch_size'):
        value = get_value(ds, key)
        if value is not None and value != AUTO:
            _expect(ds, key, _is_int(value) and value > 0, 'a positive integer or "auto"')
    clip = get_value(ds, 'gradient_clipping')
    if clip is not None and clip != AUTO:
        _expect(ds, 'gradient_clipping',
                isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0,
                'a non-negative number or "auto"')
    steps = get_value(ds, 'steps_per_print')
    if steps is not None:
        _expect(ds, 'steps_per_print', _is_int(steps) and steps > 0, 'a positive integer')
    for section in ('zero_optimization', 'fp16', 'bf16', 'bfloat16'):
        value = get_value(ds, section)
        if value is not None:
            _expect(ds, section, isinstance(value, Mapping), 'a dict')
        enabled = get_value(ds, f'{section}.enabled')
        if enabled is not None and f'{section}.enabled' in FILLED_KEYS:
            _expect(ds, f'{section}.enabled', isinstance(enabled, bool) or enabled == AUTO,
                    'true, false or "auto"')
        elif enabled is not None:
            _expect(ds, f'{section}.enabled', isinstance(enabled, bool), 'true or false')
    stage = get_value(ds, 'zero_optimization.stage')
    if stage is not None:
        _expect(ds, 'zero_optimization.stage', _is_int(stage) and 0 <= stage <= 3,
                'one of 0, 1, 2, 3')
    for part in ('offload_optimizer', 'offload_param'):
        key = f'zero_optimization.{part}'
        value = get_value(ds, key)
        if value is None:
            continue
        _expect(ds, key, isinstance(value, Mapping), 'a dict such as {"device": "cpu"}')
        device = get_value(ds, f'{key}.device', 'none')
        _expect(ds, f'{key}.device', device in OFFLOAD_DEVICES, f'one of {OFFLOAD_DEVICES}')
    if offload_devices(ds)[1] is not None and get_value(ds, 'zero_optimization.stage', 0) != 3:
        raise DsConfigError(
            'ds_config.zero_optimization.offload_param needs zero_optimization.stage 3; '
            'use offload_optimizer with stages 1-2.')


def offload_devices(ds_config: Mapping[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """``(optimizer device, parameter device)`` ZeRO offloads to, None where not offloaded."""
    zero = ds_config.get('zero_optimization') or {}
    devices = []
    for key in ('offload_optimizer', 'offload_param'):
        device = (zero.get(key) or {}).get('device')
        devices.append(device if device in ('cpu', 'nvme') else None)
    return devices[0], devices[1]


def check_precision(ds: Mapping[str, Any], cuda_available: bool) -> None:
    """Refuse fp16 together with bf16, and fp16 without CUDA."""
    bf16 = enabled(ds, 'bf16') or enabled(ds, 'bfloat16')
    fp16 = enabled(ds, 'fp16')
    if bf16 and fp16:
        raise DsConfigError(
            'ds_config enables both fp16.enabled and bf16.enabled; enable one of them.')
    if fp16 and not cuda_available:
        raise DsConfigError(
            'ds_config.fp16.enabled is true, but fp16 training needs CUDA and none is '
            'available here; use bf16=dict(enabled=True) instead, which works on CPU.')
