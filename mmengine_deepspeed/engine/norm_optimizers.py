"""Optimizers whose math reads each parameter's norm (LARS, LAMB), stepped on ZeRO's partitions.

LARS scales each parameter's step by its weight norm over its gradient norm; LAMB
clips all gradients by their global norm and scales each parameter's update by its
weight norm over the update's norm. ZeRO-1/2/3 (and DeepSpeed's bf16 optimizer at
ZeRO-0) hand the optimizer this rank's flat partition of each param group, one
``step()`` call per group (ZeRO-3: per sub-group), so a norm taken there covers a slice
of several parameters, or part of one: the numbers silently differ from ZeRO-0's.

For a known optimizer (:data:`NORM_MATH`) the user's instance stays what DeepSpeed
steps (its class, param groups and state names, so checkpoints and resharding see
what they expect), and its ``step`` is replaced by one that knows where each
parameter lies in the partitions (:class:`Slice`). Each call holds whole parameters
(spread over the ranks): it all-reduces their squared norms once (LAMB: the weights'
and the updates', computed from a copy of the moments; none where no parameter of the
call is scaled by a norm), then applies the optimizer's formulas to each parameter's
slice with the whole parameter's norms. LAMB's
clip by the norm of all gradients reads DeepSpeed's (``compat.clipped_global_grad_norm``).
Element-wise parts (moments, momentum, weight decay) are computed on the slices as on
whole tensors, so the result is ZeRO-0's up to the order of the norms' sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..compat import full_numel
from .norm_math import MATHS

# Optimizers by qualified class name -> the math they compute (``lars`` / ``lamb``, as
# MMPretrain 1.x's LARS and Lamb do; timm's Lamb is the one MMPretrain copied). An
# optimizer with one of these maths under another name is added here
# (``NORM_MATH['my_package.MyLars'] = 'lars'``).
NORM_MATH: dict[str, str] = {
    'mmpretrain.engine.optimizers.lars.LARS': 'lars',
    'mmpretrain.engine.optimizers.lamb.Lamb': 'lamb',
    'timm.optim.lamb.Lamb': 'lamb',
}


# Optimizers whose math needs each parameter's shape, by class name (outside DeepSpeed,
# whose own optimizers know its partitions), and what they do with it: refused at ZeRO >= 1.
SHAPE_MATH: dict[str, str] = {
    'Adafactor': 'factors its second moment into row and column statistics of each matrix',
    'Muon': 'orthogonalises each 2-D weight (Newton-Schulz iterations on the whole matrix)',
    'Shampoo': 'preconditions each weight with matrices of its own dimensions',
    'DistributedShampoo': 'preconditions each weight with matrices of its own dimensions',
    'SOAP': 'preconditions each weight with matrices of its own dimensions',
}
UNTESTED_NOTE = (
    'ZeRO steps {name} on this rank\'s flat partition of each param group, slices of '
    'several parameters: an optimizer whose math reads a parameter\'s shape or its norm '
    '(LARS, LAMB, Adafactor...) computes something else there than on ZeRO-0. Known ones '
    'are handled (docs/config.md, "Optimizers"); check that {name} is element-wise.')


def check_for_zero(optimizer: Optional[Optimizer], stage: int,
                   allow_untested: bool) -> Optional[str]:
    """Refuse an optimizer ZeRO would silently change; the note for one it does not know.

    Args:
        optimizer (Optimizer, optional): The engine's optimizer.
        stage (int): Its ZeRO stage.
        allow_untested (bool): ``zero_allow_untested_optimizer`` as the user set it.

    Returns:
        str | None: The log line for an optimizer stepped on partitions that is neither
        known element-wise (the caller's list) nor known here, when the user allowed it.

    Raises:
        ValueError: At ZeRO >= 1 for an optimizer of :data:`SHAPE_MATH`, whatever
            ``zero_allow_untested_optimizer`` says.
    """
    if optimizer is None or stage == 0:
        return None
    name = type(optimizer).__name__
    if name in SHAPE_MATH and not type(optimizer).__module__.startswith('deepspeed'):
        raise ValueError(
            f'optim_wrapper.optimizer {name} {SHAPE_MATH[name]}, and ZeRO-{stage} steps it on '
            'flat partitions that mix slices of several parameters, so it would compute '
            'something else than it does on whole parameters (zero_allow_untested_optimizer '
            'does not change that). Use ZeRO-0 (zero_optimization.stage=0: data parallel, '
            'optimizer states on every rank), or an element-wise optimizer (AdamW) at '
            f'ZeRO-{stage}.')
    if norm_math(optimizer) is None and allow_untested:
        return UNTESTED_NOTE.format(name=name)
    return None


def qualified_name(optimizer: Optimizer) -> str:
    """``module.Class`` of ``optimizer``'s class (the key of :data:`NORM_MATH`)."""
    cls = type(optimizer)
    return f'{cls.__module__}.{cls.__qualname__}'


def norm_math(optimizer: Optional[Optimizer]) -> Optional[str]:
    """The math of a known norm-reading optimizer (:data:`NORM_MATH`), else None."""
    return None if optimizer is None else NORM_MATH.get(qualified_name(optimizer))


@dataclass
class Slice:
    """Where one parameter lies in this rank's partition of its group.

    Args:
        group (int): Its param group.
        storage (int): The address of the partition it lies in (``untyped_storage()``).
        start (int): Its first element there, counted from the storage's start.
        length (int): How many of its elements this rank holds (0: none).
        first (bool): It is its group's first trainable parameter (the step() call that
            holds it is the group's first of an optimizer step).
    """

    group: int
    storage: int
    start: int
    length: int
    first: bool

    def of(self, tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's part of ``tensor``, a partition-sized companion of ``flat``
        (the partition itself, its gradient, an optimizer state)."""
        return tensor.narrow(0, self.start - int(flat.storage_offset()), self.length)

    def grad_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's part of the gradient DeepSpeed set on ``flat`` for the step."""
        if flat.grad is None:
            raise RuntimeError('DeepSpeed stepped a partition without its gradient.')
        return self.of(flat.grad, flat)


def zero12_slices(flat: torch.Tensor, members: list[nn.Parameter], group: int, rank: int,
                  world: int) -> list[Slice]:
    """Each trainable parameter's slice of this rank's ZeRO-1/2 partition of one group.

    ZeRO-1/2 (and DeepSpeed's bf16 optimizer) flatten a group's trainable parameters
    in order into one buffer, padded at its end to a multiple of the ranks, and give
    rank ``r`` the ``r``-th equal part, ``flat``.
    """
    size, base = flat.numel(), int(flat.storage_offset())
    first, last = rank * size, (rank + 1) * size
    slices, offset = [], 0
    for param in members:
        lo, hi = max(offset, first), min(offset + param.numel(), last)
        slices.append(Slice(group, flat.untyped_storage().data_ptr(),
                            base + min(max(lo - first, 0), size), max(hi - lo, 0),
                            param is members[0]))
        offset += param.numel()
    return slices


def zero3_slices(params: list[list[nn.Parameter]], rank: int) -> list[Slice]:
    """Each trainable parameter's slice of this rank's ZeRO-3 fp32 partitions.

    ZeRO-3 partitions every parameter on its own (``ceil(numel / ranks)`` elements
    each, the last rank's padded) and lays a sub-group's partitions end to end;
    DeepSpeed's public ``safe_get_local_fp32_param`` gives this rank's part of a
    parameter as a view of its sub-group's flat partition.
    """
    from deepspeed.utils import safe_get_local_fp32_param

    slices = []
    for group, members in enumerate(params):
        for param in members:
            weight = safe_get_local_fp32_param(param)
            size = weight.numel()
            slices.append(Slice(group, weight.untyped_storage().data_ptr(),
                                int(weight.storage_offset()),
                                min(max(full_numel(param) - rank * size, 0), size),
                                param is members[0]))
    return slices


@dataclass
class Call:
    """One parameter's slice in a ``step()`` call: the partition and its group's dict."""

    item: Slice
    flat: torch.Tensor
    group: dict

    def weight(self) -> torch.Tensor:
        """Its part of the fp32 partition."""
        return self.item.of(self.flat, self.flat)

    def grad(self) -> torch.Tensor:
        """Its part of the partition's gradient."""
        return self.item.grad_of(self.flat)

    def state(self, key: str, optimizer: Optimizer) -> torch.Tensor:
        """Its part of a partition-sized optimizer state (zeros when new)."""
        state = optimizer.state[self.flat]
        if key not in state:
            state[key] = torch.zeros_like(self.flat)
        return self.item.of(state[key], self.flat)


class PartitionedNormStep:
    """The ``step`` of a norm-reading optimizer on ZeRO's partitions.

    DeepSpeed calls it once per param group (ZeRO-1/2), per sub-group (ZeRO-3) or
    once for all groups (its bf16 optimizer), each time with the partitions of
    whole parameters: each call reduces the squared norms of its parameters in one
    all-reduce (none where the call holds no parameter a norm scales), then steps them.
    The math (``norm_math.py``: ``Lars``, ``Lamb``) says which groups are ``scaled``,
    what is ``normed`` per slice, the ``scales`` from the reduced norms, and how a slice
    is stepped.

    Args:
        optimizer (Optimizer): The user's optimizer, before ``deepspeed.initialize``
            (its param groups still hold the parameters).
        math_name (str): ``'lars'`` or ``'lamb'``.
        stage (int): ZeRO stage.
        global_grad_norm (Callable[[], torch.Tensor]): The norm of all gradients this
            step after DeepSpeed's clipping (LAMB clips by it).
    """

    def __init__(self, optimizer: Optimizer, math_name: str, stage: int,
                 global_grad_norm: Callable[[], torch.Tensor]):
        self.optimizer = optimizer
        self.math = MATHS[math_name]
        self.stage = stage
        self.global_grad_norm = global_grad_norm
        # DeepSpeed steps one group at a time, in a list of that group's dict alone, and a
        # resume replaces the dicts (torch's load_state_dict): a partition's group is
        # found from the partition, its settings read from the dict of the call
        self.group_dicts = list(optimizer.param_groups)
        self.params = [[p for p in g['params'] if p.requires_grad]
                       for g in optimizer.param_groups]
        self.whole: Optional[bool] = None  # fp32/fp16 ZeRO-0 step whole parameters
        self.layout: dict[int, list[Slice]] = {}  # by partition (its storage's address)
        # per-slice settings on the device, made once per distinct values (no copy to the
        # device in a steady step)
        self.settings: dict[tuple, torch.Tensor] = {}

    def install(self) -> None:
        """Make this the optimizer's ``step`` (an instance attribute: the class keeps its own)."""
        vars(self.optimizer)['step'] = self.step

    def _slices(self, flat: torch.Tensor) -> list[Slice]:
        storage = flat.untyped_storage().data_ptr()
        if not self.layout:
            if self.stage == 3:
                for item in zero3_slices(self.params, dist.get_rank()):
                    self.layout.setdefault(item.storage, []).append(item)
            else:  # the dicts as DeepSpeed filled them: each group's partition
                for group, group_dict in enumerate(self.group_dicts):
                    if self.params[group]:
                        part = group_dict['params'][0]
                        self.layout[part.untyped_storage().data_ptr()] = zero12_slices(
                            part, self.params[group], group, dist.get_rank(),
                            dist.get_world_size())
        return self.layout[storage]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        """Step the parameters whose partitions are in the param groups now."""
        if closure is not None:
            raise ValueError('DeepSpeed steps this optimizer without a closure.')
        groups = [g for g in self.optimizer.param_groups if g['params']]
        if self.whole is None:
            originals = {id(p) for members in self.params for p in members}
            self.whole = any(id(p) in originals for g in groups for p in g['params'])
        if self.whole:
            type(self.optimizer).step(self.optimizer)
            return
        items = [Call(item, flat, g) for g in groups for flat in g['params']
                 for item in self._slices(flat)]
        if not items:
            return
        fresh = {id(c.flat): not self.optimizer.state.get(c.flat) for c in items}
        norms = self.math.before(self, items)
        # one all-reduce per call, none where no parameter of the call is scaled by a norm
        # (LARS' lars_exclude groups, LAMB without weight decay): the decision reads only
        # group settings, the same on every rank
        if any(self.math.scaled(c.group) for c in items):
            # each slice's norm as torch.norm takes it, squared in float64 (exactly): a
            # parameter that lies in one rank's partition gets the whole tensor's norm to
            # the bit
            here = [torch.linalg.vector_norm(t) for c in items
                    for t in self.math.normed(self, c, norms)]
            sums = torch.stack(here).double().pow(2).view(len(items), -1).t().contiguous()
            dist.all_reduce(sums)
            norms.update(self.math.scales(self, items, sums.sqrt().unbind(0)))
        for index, call in enumerate(items):
            if call.item.length:
                self.math.apply(self, call, norms, index, fresh[id(call.flat)])
