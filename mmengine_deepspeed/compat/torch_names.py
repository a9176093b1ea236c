"""The torch names of :mod:`mmengine_deepspeed.compat` (see its docstring)."""
from __future__ import annotations

from typing import Any, Callable, Optional, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode

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


def writes_first_operand(func: Any) -> bool:
    """Whether an ATen op, as a dispatch mode gets it, writes its first argument (in-place
    ops, ``copy_``): its schema, which torch exposes only as ``OpOverload._schema``. Pinned
    by tests/unit/test_compat.py."""
    arguments = func._schema.arguments
    return bool(arguments and arguments[0].alias_info is not None
                and arguments[0].alias_info.is_write)


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
