"""Every touch of a private DeepSpeed, MMEngine or torch name, in one package.

Where no public API does what we need, the private name is used here and only
here (``deepspeed_names.py``, ``mmengine_names.py``, ``torch_names.py``, all
imported from ``compat``), each with the reason and the test that pins the
behaviour we rely on.
Methods we override under a private name stay in their classes (marked
``@override``, which mypy checks against MMEngine) and are listed in
:data:`PRIVATE_NAMES` too. At import, :func:`check_upstream` warns when the
installed DeepSpeed or MMEngine is outside the supported range, or when a
private name we use or override is gone: an upstream rename then says so at
once, instead of silently skipping an override.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any, Optional

from packaging.version import Version

# Each upstream package's names live in a module of their own, imported from here.
from .deepspeed_names import (
    SKIP_BROADCAST_MARK,
    backward_prologue,
    clipped_global_grad_norm,
    end_interrupted_backward,
    full_numel,
    full_shape,
    gather_whole,
    has_separate_master,
    is_released,
    is_zero3_param,
    keep_local_slices,
    local_partition,
    mark_op_unavailable,
    partition_group,
    release_module_params,
    release_process_group_references,
    set_full_shape,
    skip_engine_broadcast,
)
from .mmengine_names import (
    InfiniteDataloaderIterator,
    accumulative_counts,
    backward_counts,
    call_with_hooks,
    count_backward,
    diff_rank_seed,
    ema_started,
    found_inf_supported,
    randomness_cfg,
    register_message_hub,
    route_from_cfg_to,
    save_with_checkpoint_hook,
    scalar_histories,
    set_backward_counts,
    set_experiment_name,
    set_loop_position,
)
from .torch_names import (
    TO_COPY,
    TorchDispatchMode,
    autograd_sequence_number,
    cpu_probes,
    dynamo_counts,
    hook_dict_of,
    module_hook_dicts,
    onednn_bf16_matmul,
    storage_key,
    writes_first_operand,
    zero3_module_hooks,
)

__all__ = [
    'PRIVATE_NAMES',
    'SKIP_BROADCAST_MARK',
    'SUPPORTED',
    'TO_COPY',
    'InfiniteDataloaderIterator',
    'TorchDispatchMode',
    'accumulative_counts',
    'autograd_sequence_number',
    'backward_counts',
    'backward_prologue',
    'call_with_hooks',
    'check_upstream',
    'clipped_global_grad_norm',
    'count_backward',
    'cpu_probes',
    'diff_rank_seed',
    'dynamo_counts',
    'ema_started',
    'end_interrupted_backward',
    'found_inf_supported',
    'full_numel',
    'full_shape',
    'gather_whole',
    'has_separate_master',
    'hook_dict_of',
    'is_released',
    'is_zero3_param',
    'keep_local_slices',
    'local_partition',
    'mark_op_unavailable',
    'missing_private_names',
    'module_hook_dicts',
    'onednn_bf16_matmul',
    'partition_group',
    'randomness_cfg',
    'register_message_hub',
    'release_module_params',
    'release_process_group_references',
    'route_from_cfg_to',
    'save_with_checkpoint_hook',
    'scalar_histories',
    'set_backward_counts',
    'set_experiment_name',
    'set_full_shape',
    'set_loop_position',
    'skip_engine_broadcast',
    'storage_key',
    'unsupported_versions',
    'writes_first_operand',
    'zero3_module_hooks',
]

# Supported [lowest, next-unsupported) versions; pyproject.toml pins the same.
SUPPORTED = {'deepspeed': ('0.19', '0.20'), 'mmengine': ('0.10.7', '0.11')}

# (module, class (a dotted path from the module) or None, name): the private names used or
# overridden, and why.
PRIVATE_NAMES: tuple[tuple[str, Optional[str], str, str], ...] = (
    ('deepspeed.runtime.engine', 'DeepSpeedEngine', '_backward_prologue',
     'ZeRO-3 gradient accumulation through an optimizer stepped outside the engine\'s '
     'forward (tests/dist/test_train.py parity_custom_step_zero3_accum2)'),
    ('deepspeed.ops', None, '_probe_compatible_ops',
     'the ops DeepSpeed may JIT-build (``__compatible_ops__``, made by it): the CPU '
     'inference all-reduce op not built for training (tests/unit/test_compat/)'),
    ('deepspeed.utils.groups', None, '_release_process_group_references',
     'a second world in one process (tests/dist/test_runner_contract.py)'),
    ('deepspeed.runtime.zero.partition_parameters', 'Init', '_zero_init_param',
     'overridden: 0-dim parameters built partitioned, parameters cast to Init.dtype there '
     '(tests/dist/test_partitioned.py)'),
    ('deepspeed.runtime.zero.partition_parameters', 'Init', '_post_init_method',
     'overridden: DeepSpeed partitioning a just-built module, untouched by the gathering '
     'that construction code gets (tests/dist/test_partitioned.py parent_init)'),
    ('mmengine.hooks', 'CheckpointHook', '_save_checkpoint_with_step',
     'overridden: rotation after the save; called for preemption checkpoints '
     '(tests/unit/test_checkpoint_files.py, tests/dist/test_failures.py)'),
    ('mmengine.hooks', 'CheckpointHook', '_publish_model',
     'overridden: publishing from a checkpoint directory (tests/dist/test_checkpoint_hook.py)'),
    ('mmengine.runner.loops', None, '_InfiniteDataloaderIterator',
     'subclassed: the iteration loop\'s iterator keeps MMEngine\'s type '
     '(tests/unit/test_data_order.py)'),
    ('mmengine.hooks', 'EMAHook', '_ema_started',
     'whether EMA averaging began (tests/dist/test_checkpoint.py EMA cases)'),
    ('mmengine.runner', 'Runner', '_init_model_weights',
     'overridden: init_weights() runs before the engines (tests/unit/test_runner.py)'),
    ('mmengine.hooks', 'EMAHook', '_swap_ema_parameters',
     'overridden: swapping gathered ZeRO-3 weights (tests/dist/test_checkpoint.py EMA cases)'),
    ('mmengine.logging', 'MessageHub', '_instance_dict',
     'the runner\'s DeferredMessageHub is MMEngine\'s current hub '
     '(tests/unit/test_message_hub.py)'),
    ('torch._dynamo.utils', None, 'counters',
     'the compile report of compile=... runs (tests/dist/test_compile.py)'),
    ('torch.utils._python_dispatch', None, 'TorchDispatchMode',
     'subclassed: plan sees the operands of the kernels a traced step calls (torch documents '
     'it in "Extending PyTorch" but exports it from no public module; '
     'tests/unit/test_plan_transients.py)'),
    ('torch._ops', 'ops.aten.copy_.default', '_schema',
     'which operand an ATen op writes: the first-iteration guard tells a write to a released '
     'ZeRO-3 parameter from a read (tests/unit/test_compat.py, tests/dist/test_in_step.py)'),
    ('torch._ops', 'ops.aten', '_to_copy',
     'the op behind Tensor.to(device): plan\'s trace keeps a meta tensor moved to the CPU on '
     'meta (an ATen core-IR op; tests/unit/test_plan_activations.py)'),
    ('torch._ops', 'ops.mkldnn', '_is_mkldnn_bf16_supported',
     'whether the CPU\'s bf16 bmm copies a broadcast operand (plan/transients.py; '
     'tests/unit/test_plan_transients.py)'),
    ('deepspeed.runtime.zero.partitioned_param_coordinator', 'PartitionedParameterCoordinator',
     'release_and_reset_all',
     'undocumented: a ZeRO-3 model updating its own averaged copy waits for the prefetches '
     'in flight and releases both copies first (tests/dist/test_in_step.py)'),
    ('deepspeed.runtime.base_optimizer', 'ZeROOptimizer', '_backward_active_depth',
     'an interrupted backward left, for a retried iteration (engine/split_retry.py; '
     'tests/dist/test_layout.py out-of-memory cases)'),
    ('torch.autograd.graph', 'Node', '_sequence_nr',
     'the same-parameters check walks the graph again only when its size changed '
     '(tests/unit/test_compat/)'),
)


def _version(package: str) -> Optional[Version]:
    try:
        return Version(importlib.import_module(package).__version__)
    except (ImportError, AttributeError, ValueError):
        return None


def unsupported_versions() -> list[str]:
    """The installed packages outside :data:`SUPPORTED`, as readable lines."""
    lines = []
    for package, (lowest, above) in SUPPORTED.items():
        found = _version(package)
        if found is not None and not Version(lowest) <= found < Version(above):
            lines.append(f'{package} {found} (supported: >={lowest},<{above})')
    return lines


def missing_private_names() -> list[str]:
    """The private names of :data:`PRIVATE_NAMES` that the installed packages lack."""
    missing = []
    for module_name, class_name, name, why in PRIVATE_NAMES:
        try:
            owner: Any = importlib.import_module(module_name)
            for part in class_name.split('.') if class_name else ():
                owner = getattr(owner, part)
        except (ImportError, AttributeError):
            missing.append(f'{module_name}.{class_name or ""} (for {why})')
            continue
        if not hasattr(owner, name):
            missing.append(f'{module_name}.{class_name + "." if class_name else ""}{name} '
                           f'(for {why})')
    return missing


def check_upstream() -> None:
    """Warn once, naming the fix, when DeepSpeed / MMEngine are not what we support."""
    versions, missing = unsupported_versions(), missing_private_names()
    if versions:
        warnings.warn('mmengine-deepspeed is tested with ' + '; '.join(versions) + '. Install '
                      'the supported versions (pip install "deepspeed>=0.19,<0.20" '
                      '"mmengine>=0.10.7,<0.11"); others may train differently.', stacklevel=2)
    if missing:
        warnings.warn('These names that mmengine-deepspeed relies on are gone from the '
                      'installed packages, so the features listed will not work: '
                      + '; '.join(missing), stacklevel=2)

