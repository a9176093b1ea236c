"""Every touch of a private DeepSpeed, MMEngine or torch name, in one place.

Where no public API does what we need, the private name is used here and only
here, each with the reason and the test that pins the behaviour we rely on.
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
from typing import Any, Callable, Optional, cast

import torch
from mmengine.runner.loops import _InfiniteDataloaderIterator
from packaging.version import Version
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode

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
     'inference all-reduce op not built for training (tests/unit/test_compat.py)'),
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
     '(tests/unit/test_checkpoint_data_order.py)'),
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
    ('torch.autograd.graph', 'Node', '_sequence_nr',
     'the same-parameters check walks the graph again only when its size changed '
     '(tests/unit/test_compat.py)'),
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


# --- DeepSpeed -------------------------------------------------------------------------

def backward_prologue(engine: Any) -> None:
    """DeepSpeed's per-backward bookkeeping, for a backward the engine did not start.

    ``engine.backward`` runs it only for losses of the engine's own forward;
    no public API runs it otherwise (see :data:`PRIVATE_NAMES`).
    """
    engine._backward_prologue()


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


# --- MMEngine ---------------------------------------------------------------------------

# IterBasedTrainLoop.dataloader_iterator's type, which code (and MMEngine's own tests)
# checks: the resumable loop's iterator subclasses it (tests/unit/test_checkpoint_data_order.py).
InfiniteDataloaderIterator = _InfiniteDataloaderIterator

def accumulative_counts(wrapper: Any) -> int:
    """An ``OptimWrapper``'s ``accumulative_counts`` (stored, but not exposed)."""
    return int(wrapper._accumulative_counts)


def count_backward(wrapper: Any) -> None:
    """Count one backward as MMEngine's ``OptimWrapper.backward`` does (``_inner_count``,
    an instance attribute its accumulation boundaries read; no public counter). Pinned by
    tests/unit/test_compat.py."""
    wrapper._inner_count += 1


def found_inf_supported(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` skips on the device when given ``found_inf``: torch's
    fused optimizers, which set ``_step_supports_amp_scaling`` (read by
    ``torch.amp.GradScaler``; no public flag). Pinned by tests/unit/test_compat.py."""
    return bool(getattr(optimizer, '_step_supports_amp_scaling', False))


def ema_started(hook: Any, runner: Any) -> bool:
    """Whether MMEngine's ``EMAHook`` has begun averaging (its ``begin_iter`` /
    ``begin_epoch``; ``EMAHook._ema_started``, no public one)."""
    return bool(hook._ema_started(runner))


def set_experiment_name(runner: Any, name: str) -> None:
    """Set ``Runner.experiment_name`` (read-only property over ``_experiment_name``),
    before the logger and message hub take it."""
    runner._experiment_name = name


def save_with_checkpoint_hook(hook: Any, runner: Any, step: int, meta: dict) -> None:
    """Save as ``CheckpointHook`` saves at ``step``: its file name, its ``max_keep_ckpts``
    rotation, ``last_checkpoint``. No public method saves outside its interval; the
    preemption checkpoint needs one (tests/dist/test_failures.py)."""
    hook._save_checkpoint_with_step(runner, step, meta)


def randomness_cfg(runner: Any) -> dict:
    """The runner's ``randomness`` settings (``Runner._randomness_cfg``, an instance
    attribute set in ``Runner.__init__``; no public accessor)."""
    return cast(dict, runner._randomness_cfg)


def diff_rank_seed(runner: Any) -> bool:
    """``randomness.diff_rank_seed`` as the runner holds it (MMEngine's loops read it the same
    way to build their dataloader)."""
    return bool(randomness_cfg(runner).get('diff_rank_seed', False))


def call_with_hooks(runner: Any, hooks: list, call_hook: Callable[..., None], fn_name: str,
                    kwargs: dict) -> None:
    """``call_hook(fn_name, **kwargs)`` with ``hooks`` as ``runner``'s hook list for the
    call (MMEngine's ``call_hook`` iterates ``Runner._hooks``, which ``runner.hooks``
    returns; DeepSpeedRunner adds its own hooks there for one call only,
    tests/dist/test_runner_contract.py). One function, twice per iteration: a try, not a
    context manager."""
    registered = runner._hooks
    runner._hooks = hooks
    try:
        call_hook(fn_name, **kwargs)
    finally:
        runner._hooks = registered


def set_loop_position(loop: Any, epoch: int, iteration: int) -> None:
    """Restore a train loop's epoch and iteration (MMEngine's ``resume`` does the same)."""
    loop._epoch = epoch
    loop._iter = iteration


def route_from_cfg_to(runner_class: type) -> None:
    """``Runner.from_cfg(cfg)`` builds the runner ``cfg.runner_type`` names where that is
    ``runner_class`` or a subclass: MMagic's ``tools/train.py`` calls it whatever the config
    says (MMDetection's builds ``RUNNERS.build(cfg)``), which trained a plain ``Runner``
    silently. Only ``Runner.from_cfg`` itself is routed (a subclass's, and so
    ``RUNNERS.build``, are MMEngine's) and only for such a ``runner_type``; calling this
    again changes nothing. Pinned by tests/unit/test_compat.py and tests/dist/test_setup.py.
    """
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    plain = Runner.__dict__['from_cfg'].__func__
    if getattr(plain, 'routes_to', None) is not None:
        return

    def from_cfg(cls: type, cfg: Any) -> Any:
        if cls is Runner:
            named = cfg.get('runner_type')
            chosen = RUNNERS.get(named) if isinstance(named, str) else named
            if isinstance(chosen, type) and issubclass(chosen, runner_class):
                return RUNNERS.build(cfg)
        return plain(cls, cfg)

    from_cfg.__doc__ = plain.__doc__
    from_cfg.routes_to = runner_class  # type: ignore[attr-defined]
    Runner.from_cfg = classmethod(from_cfg)  # type: ignore[method-assign,assignment]


# --- torch ------------------------------------------------------------------------------

# torch documents its dispatch modes ("Extending PyTorch") but exports the base class from no
# public module; plan/transients.py subclasses it (tests/unit/test_plan_transients.py)
TorchDispatchMode = _TorchDispatchMode
# ATen's op behind Tensor.to(device=...), as a dispatch mode sees it (PRIVATE_NAMES).
TO_COPY = torch.ops.aten._to_copy.default


def dynamo_counts() -> dict[str, int]:
    """dynamo's process-wide compile counters (torch has no public API for them; pinned by
    tests/dist/test_compile.py, which reads them through the runner's log)."""
    from torch._dynamo.utils import counters
    return {'frames': int(counters['frames']['total']),
            'graphs': int(counters['stats']['unique_graphs']),
            'graph_breaks': int(sum(counters['graph_break'].values()))}


def autograd_sequence_number(tensor: torch.Tensor) -> Optional[int]:
    """How many autograd nodes this thread had created before ``tensor``'s (None for a
    tensor without one): the difference between two losses' numbers is the size of the graph
    built in between, at no cost. torch numbers nodes so (``Node._sequence_nr``) but has no
    public accessor; pinned by tests/unit/test_compat.py."""
    node = tensor.grad_fn
    return None if node is None else int(node._sequence_nr())


def module_hook_dicts(module: nn.Module) -> tuple[dict, ...]:
    """A module's forward/backward hook dicts: torch removes hooks only by handle, and a
    copy of a module carries its hooks without their handles."""
    return (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
            module._backward_hooks)


def zero3_module_hooks(engine: Any) -> list:
    """The handles of the hooks a ZeRO-3 engine put on every submodule (forward and
    backward; ``DeepSpeedZeRoOffload.forward_hooks`` / ``backward_hooks``, no public
    accessor), or [] below ZeRO-3 (tests/dist/test_patterns.py, parameterless modules)."""
    offload = getattr(engine.optimizer, 'parameter_offload', engine.optimizer)
    return [*getattr(offload, 'forward_hooks', []), *getattr(offload, 'backward_hooks', [])]


def hook_dict_of(handle: Any) -> Optional[dict]:
    """The hook dict a torch ``RemovableHandle`` removes from (None once it is gone)."""
    return cast(Optional[dict], handle.hooks_dict_ref())


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage, alike for every view of it, also on the meta device (where
    data_ptr() is 0 for all): the StorageImpl's address. torch has no public identity for a
    storage; pinned by tests/unit/test_compat.py."""
    return int(tensor.untyped_storage()._cdata)


def onednn_bf16_matmul() -> bool:
    """Whether this CPU's bf16 matmuls go to oneDNN (mkldnn enabled, and torch's own probe
    of the CPU's bf16 support, ``torch.ops.mkldnn._is_mkldnn_bf16_supported``, which torch
    exports under no public name): that path copies a ``bmm`` operand broadcast over its
    batch. Pinned on any CPU by tests/unit/test_plan_transients.py."""
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_probes() -> list[Callable[[], bool]]:
    """torch's CPU feature probes for native bf16 (AVX512-BF16, AMX); private in torch.cpu,
    pinned against /proc/cpuinfo by tests/unit/test_upstream_traps.py."""
    names = ('_is_avx512_bf16_supported', '_is_amx_tile_supported')
    return [probe for probe in (getattr(torch.cpu, name, None) for name in names)
            if probe is not None]


def scalar_histories(hub: Any) -> dict:
    """A MessageHub's histories by key: the dict itself (``MessageHub._log_scalars``, an
    instance attribute; the ``log_scalars`` property returns the same dict, but the runner's
    hub reads its kept tensors before it returns). Pinned by tests/unit/test_compat.py."""
    return cast(dict, hub._log_scalars)


def register_message_hub(name: str, hub: Any) -> None:
    """Make ``hub`` (a MessageHub subclass's instance) what ``MessageHub.get_instance(name)``
    and ``MessageHub.get_current_instance()`` return: MMEngine's ``ManagerMixin`` keeps one
    private ``_instance_dict`` per class, so a subclass's instances are not MessageHub's.
    Pinned by tests/unit/test_message_hub.py."""
    from mmengine.logging import MessageHub

    instances = MessageHub._instance_dict
    instances.pop(name, None)  # the newest is the current one
    instances[name] = hub
