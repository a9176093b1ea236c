"""The start-up lines of an engine: how it is distributed, and a note on emulated bf16."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..compat import full_numel, local_partition
from ..config.checks import offload_devices
from ..config.resolve import precision, zero_stage
from ..dist import native_bf16


def parameter_counts(module: torch.nn.Module) -> tuple[int, int]:
    """(total parameters, parameters held by this rank); ZeRO-3 holds a partition."""
    total = held = 0
    for param in module.parameters():
        numel = full_numel(param)
        total += numel
        partition = local_partition(param)
        held += int(partition.numel()) if partition is not None else numel
    return total, held


def banner(ds_config: dict, world_size: int, module: torch.nn.Module,
           has_optimizer: bool, name: Optional[str] = None) -> str:
    """The one-paragraph summary of how an engine is distributed (``name``: one of several)."""
    micro = ds_config['train_micro_batch_size_per_gpu']
    accum = ds_config['gradient_accumulation_steps']
    offload = dict(zip(('optimizer', 'param'),
                       (device or 'none' for device in offload_devices(ds_config))))
    total, held = parameter_counts(module)
    backend = dist.get_backend() if dist.is_initialized() else 'none'
    engine = 'DeepSpeed engine' if name is None else f'DeepSpeed engine {name!r}'
    return (f'{engine} ready: ZeRO-{zero_stage(ds_config)}, {precision(ds_config)}, '
            f'world size {world_size}, backend {backend}, offload optimizer={offload["optimizer"]} '
            f'param={offload["param"]}, micro batch {micro}, accumulation {accum}, effective '
            f'batch {micro * accum * world_size}, parameters {total:,} ({held:,} on this rank), '
            f'{"with" if has_optimizer else "without"} optimizer.')


# Measured with the demo (tiny GPT, ZeRO-3, 2 ranks) on an AMD EPYC with AVX2
# only: 2.45-2.58 s per iteration in bf16 against 0.54-0.68 s in fp32.
EMULATED_BF16_SLOWDOWN = '3.6-4.5x'


def precision_note(requested: Any, chosen: str, on_cuda: bool) -> Optional[str]:
    """The line to log about bf16 on a CPU that emulates it, if any.

    Args:
        requested (Any): ``bf16.enabled`` as the user wrote it.
        chosen (str): The resolved precision (``'bf16'``, ``'fp16'``, ``'fp32'``).
        on_cuda (bool): Whether the engine runs on CUDA.

    Returns:
        str, optional: One line for the log, or None when there is nothing to say.
    """
    if on_cuda:
        return None
    if requested == 'auto' and chosen == 'fp32':
        return ('bf16.enabled="auto": training in fp32, since this CPU has no native bf16 '
                '(AVX512-BF16 or AMX); bf16 would be emulated, about '
                f'{EMULATED_BF16_SLOWDOWN} slower.')
    if requested is True and chosen == 'bf16' and not native_bf16():
        return (f'bf16 on this CPU is emulated (no AVX512-BF16 or AMX): measured '
                f'{EMULATED_BF16_SLOWDOWN} slower per iteration than fp32. Set '
                'ds_config.bf16.enabled="auto" (bf16 where the hardware has it) or false.')
    return None
