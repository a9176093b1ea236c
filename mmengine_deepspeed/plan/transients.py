"""Memory a CPU kernel takes for one call beyond its output: broadcast operands of ``bmm``.

``torch.matmul`` of a 3-d input that is not contiguous (``nn.MultiheadAttention``
with ``batch_first=True`` transposes its input) and a weight that needs no gradient
(a frozen layer) does not fold into one matrix product: it expands the weight over
the input's leading dimension and calls ``bmm``. CUDA's batched GEMM reads the
expanded (stride-0) operand in place, and so does the CPU's fp32 kernel; where the
CPU's 16-bit matmuls go to oneDNN (a CPU with bf16 support, mkldnn enabled) the operand
is copied whole first (torch 2.13: 64 x a 3072 x 1024 bf16 weight is a 390 MiB
transient for a 12 x 64 x 1024 input, in each frozen attention layer, forward and
backward). Autograd saves none of it, so :class:`~.saved.SavedTensorCounter`
cannot see it; the decomposition runs on the meta device too, so a dispatch mode
over the traced step sees each such call's operands.
"""
from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from ..compat import TorchDispatchMode, onednn_bf16_matmul

_BATCHED = {torch.ops.aten.bmm.default: (0, 1), torch.ops.aten.baddbmm.default: (1, 2)}


class BroadcastOperands(TorchDispatchMode):
    """The largest operand, in elements, that a ``bmm`` / ``baddbmm`` in the traced step
    reads broadcast over its batch (stride 0 over more than one batch entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    @override
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        operands = _BATCHED.get(func)
        if operands is not None:
            for index in operands:
                tensor = args[index]
                if tensor.dim() == 3 and tensor.shape[0] > 1 and tensor.stride(0) == 0:
                    self.largest = max(self.largest, tensor.numel())
        return func(*args, **(kwargs or {}))


def copies_broadcast(cuda: bool, element_size: int) -> bool:
    """Whether ``bmm`` copies a broadcast operand whole here: the CPU's 16-bit matmuls
    through oneDNN (bf16: DeepSpeed trains no fp16 on the CPU)."""
    return not cuda and element_size < 4 and onednn_bf16_matmul()
