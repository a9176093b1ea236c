"""Bytes per rank for one engine layout: DeepSpeed's model states, buffers and transients.

One :class:`MemoryLayout` (ZeRO stage, offload, precision, ranks, micro-batch) and
an engine's census give the parts DeepSpeed 0.19 allocates on each rank, as
its ZeRO optimizers lay them out (``stage_1_and_2.py``, ``stage3.py``,
``bf16_optimizer.py``). The peak is the larger of two moments of a step:
backward (activations and gradients being produced, buckets filling) and the
optimizer step (states and transients of the step).

On CUDA the figure is what the allocator counts (``max_memory_allocated``);
a bucket counts whole. On the CPU it is the process's RSS, in which a bucket
counts only as far as gradients are written into it (untouched pages of
``torch.empty`` are not resident) unless torch's deterministic mode fills every
``torch.empty`` (MMEngine's ``randomness.deterministic``), and freed memory that
glibc keeps in its heap stays counted: :data:`CPU_HEAP_KEPT` models that from
measurements.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

import torch

from ..config.model_settings import DEEPSPEED_REDUCE_BUCKET
from .activations import Activations
from .census import EngineCensus

MIB = 2**20
# DeepSpeed 0.19's defaults, in elements.
REDUCE_BUCKET = DEEPSPEED_REDUCE_BUCKET
ALLREDUCE_BUCKET = DEEPSPEED_REDUCE_BUCKET  # ZeRO-0's gradient all-reduce, the same size
                                           # (engine.MEMORY_OPT_ALLREDUCE_SIZE)
PERSISTENCE = 100_000
# On the CPU the RSS keeps what glibc's heap keeps: freed gradients, gathered parameters,
# all-reduce copies and optimizer temporaries (its mmap threshold rises to each freed
# block's size, up to 32 MiB, so later blocks of that size come from the heap and stay).
# No allocator model predicts that; these are fitted per ZeRO stage to the 40 fp32 runs of
# benchmarks/plan_accuracy.py's fitted set (10 shapes of 3 model families, 2 ranks, 10
# iterations; `--fit`: the worst |ln(plan / measured)| the smallest, none under 0.95;
# RESULTS.md section 6), with the kernels' transients counted apart (plan/transients.py):
# (bytes kept per byte of the fp32 model, per byte of activations), and what the runtime
# adds on top of the process's RSS before the config's model and data are built (the
# process group, DeepSpeed's engine and ZeRO modules, the runner's hooks, the data), MiB;
# ZeRO-3's is 30 MiB above its fit, which read RetinaNet 8-10 % under at ZeRO-3
# (benchmarks/real_configs.py, RESULTS.md section 7).
CPU_HEAP_KEPT = {0: (0.8, 0.65), 1: (0.1, 0.7), 2: (1.1, 0.55), 3: (1.5, 1.65)}
CPU_RUNTIME_MIB = {0: 100.0, 1: 140.0, 2: 170.0, 3: 130.0}


@dataclass(frozen=True)
class MemoryLayout:
    """How one planned run lays out its engines.

    Args:
        stage (int): ZeRO stage.
        offload_optimizer (bool): Optimizer states and master weights on the host.
        offload_param (bool): Parameters on the host (ZeRO-3).
        compute_bytes (int): Element size of parameters and activations (4 fp32, 2 bf16/fp16).
        ranks (int): Data-parallel ranks.
        micro_batch (int): Samples per rank per step.
        cuda (bool): Device memory is the CUDA allocator's (else host RSS).
        filled (bool): ``torch.empty`` is filled (torch's deterministic mode), so a
            bucket is resident whole on the CPU too. Defaults to False.
    """

    stage: int
    offload_optimizer: bool
    offload_param: bool
    compute_bytes: int
    ranks: int
    micro_batch: int
    cuda: bool
    filled: bool = False


def fills_empty(cfg: Any) -> bool:
    """Whether the run fills every ``torch.empty``: MMEngine's ``randomness.deterministic``
    turns on torch's deterministic algorithms, whose ``fill_uninitialized_memory`` (on by
    default) writes each new buffer whole."""
    randomness = cfg.get('randomness') or {}
    return bool(randomness.get('deterministic')) and \
        torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]


@dataclass
class Breakdown:
    """Bytes on one rank at the moments of a step that can hold the peak.

    Args:
        held (float): Held all step long: parameters, master weights, optimizer states,
            buffers allocated once.
        backward (float): Beside ``held`` during backward, besides activations: buckets
            filling, gathered parameters, gradients being produced.
        after_backward (float): Beside ``held`` once backward is done: gradients and
            the buffers that reduce them.
        step (float): Beside ``held`` during the optimizer step.
        host (float): Offloaded to the host (optimizer, parameters).
    """

    held: float = 0.0
    backward: float = 0.0
    after_backward: float = 0.0
    step: float = 0.0
    host: float = 0.0

    def __add__(self, other: Breakdown) -> Breakdown:
        return Breakdown(*(a + b for a, b in zip(astuple(self), astuple(other))))


def engine_bytes(engine: EngineCensus, layout: MemoryLayout, zero: dict) -> Breakdown:
    """One engine's bytes on one rank under ``layout``.

    Args:
        engine (EngineCensus): What the engine holds and steps.
        layout (MemoryLayout): The row being planned.
        zero (dict): The resolved ``zero_optimization`` section (bucket sizes, limits).
    """
    n, p = layout.ranks, layout.compute_bytes
    psi, phi, k = engine.params, engine.trainable, engine.states
    layer = engine.largest_layer
    mixed = p != 4
    states, master = 4.0 * k * phi / (n if layout.stage else 1), 4.0 * phi / (n or 1)

    def touched(elements: float) -> float:
        # a bucket of `elements`; on the CPU only what gradients are written into is resident,
        # unless deterministic mode wrote it whole
        return elements if layout.cuda or layout.filled else min(elements, phi)

    if layout.stage == 0:
        # DeepSpeed's bf16 optimizer keeps fp32 master weights and fp32 gradients beside the
        # 16-bit ones; fp32 training steps the parameters themselves
        held = p * psi + states + (8.0 * phi if mixed else 0.0)
        all_reduce = p * min(phi, ALLREDUCE_BUCKET)  # the flattened gradients
        out = Breakdown(held, p * layer, p * phi + all_reduce, p * phi + 4.0 * layer)
    elif layout.stage in (1, 2):
        bucket = touched(int(zero.get('reduce_bucket_size', REDUCE_BUCKET)))
        buckets = (4 if layout.stage == 1 else p) * bucket * (2 if zero.get('overlap_comm') else 1)
        # ZeRO-1 keeps every gradient until the boundary, ZeRO-2 only its fp32 partition
        grads = p * phi if layout.stage == 1 else 0.0
        held = p * psi + master + states
        partition = 4.0 * phi / n
        out = Breakdown(held, buckets + grads + partition, buckets + grads + partition,
                        partition + 4.0 * min(layer, phi / n))
    else:
        whole = engine.at_most(int(zero.get('stage3_param_persistence_threshold', PERSISTENCE)))
        live = min(float(zero.get('stage3_max_live_parameters', 10**9)), psi - whole)
        prefetch = min(float(zero.get('stage3_prefetch_bucket_size', 50_000_000)), psi - whole)
        reduce = touched(int(zero.get('reduce_bucket_size', REDUCE_BUCKET)))
        sub_group = min(float(zero.get('sub_group_size', 10**9)), phi / n)
        # the partitioned parameters, an fp32 master partition, the optimizer's states and
        # the flat buffer of this rank's gradient partitions, all allocated by initialize
        held = p * (whole + (psi - whole) / n) + master + states + p * phi / n
        gathered = p * (max(live, layer) + prefetch)
        # an averaged model's update in the step: it and its source gathered whole
        in_step = 2.0 * p * engine.averaged
        out = Breakdown(held, gathered + p * reduce + in_step, gathered + p * reduce,
                        8.0 * sub_group)  # one sub-group's fp32 gradients and update
    if layout.offload_optimizer:
        moved = master + states
        out.held -= moved
        out.host += moved + 4.0 * phi / n  # and a pinned fp32 gradient partition
    if layout.offload_param and layout.stage == 3:
        moved = p * (psi - engine.at_most(PERSISTENCE)) / n
        out.held -= moved
        out.host += moved
    return out


def activation_bytes(activations: Activations, layout: MemoryLayout) -> float:
    """Activations saved for backward at the layout's micro-batch and compute dtype."""
    return activations.bytes_at(layout.micro_batch, layout.compute_bytes)


def transient_bytes(activations: Activations, layout: MemoryLayout) -> float:
    """What one kernel call of the step takes beside the saved activations, at most (a
    broadcast operand the CPU's bf16 ``bmm`` copies; ``plan/transients.py``)."""
    return activations.transient_at(layout.micro_batch, layout.compute_bytes, layout.cuda)


def cpu_heap_kept(stage: int, model_bytes: float, activations: float) -> float:
    """What glibc's heap keeps in the RSS beyond live tensors (:data:`CPU_HEAP_KEPT`)."""
    per_model, per_activation = CPU_HEAP_KEPT[stage]
    return per_model * model_bytes + per_activation * activations
