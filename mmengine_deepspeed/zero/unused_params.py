"""Parameters that some ranks do not use in an iteration (conditional branches, routing).

DeepSpeed reduces a gradient when autograd produces it, one collective per
bucket slice, in the order gradients become ready. A rank whose forward
skipped a parameter produces no gradient for it, so the ranks' sequences of
collectives differ: ZeRO-1/2 abort in gloo ("Received data size doesn't
match") or average the wrong slices, ZeRO-3 waits until the process-group
timeout. MMEngine users meet the same models under DDP with
``model_wrapper_cfg=dict(find_unused_parameters=True)``; that switch does the
following here:

* the loss reaches DeepSpeed's backward behind one autograd node; when
  DeepSpeed back-propagates through it, the node computes the loss's
  gradients with ``torch.autograd.grad`` (zeros for parameters this rank
  skipped) and returns them all at once, so autograd accumulates them, and
  DeepSpeed's hooks reduce them, in an order that depends only on the
  parameter list: the same on every rank. That is DDP's math, the average
  over all ranks with zeros from those that skipped (ZeRO 0-2; see
  :func:`zero3_unsupported`).

Under ZeRO-3 DeepSpeed also records the order in which submodules run and stops
when the ranks' orders differ ("Detected a disagreement on list length"). A
submodule without parameters (a loss module MMDetection's heads skip on a rank
without positive samples, an activation) has nothing to gather or release, so
:func:`untrace_parameterless_modules` takes DeepSpeed's hooks off them: only
modules with parameters, which ZeRO-3 gathers collectively, must run alike.

Without the switch, on more than one rank, the trainable parameters the
loss reaches (a walk of the autograd graph) are compared with the set all
ranks agreed on in the first iteration (one small all-reduce, then no
collective) whenever the graph's size changed, and periodically; a
difference raises, naming the parameters and the switch, instead of
DeepSpeed's reduction aborting or hanging (:class:`UsedParameters`).
"""
from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from ..compat import (
    autograd_sequence_number,
    hook_dict_of,
    module_hook_dicts,
    zero3_module_hooks,
)
from ..dist import cpu_group

_REQUIRES_GRAD = attrgetter('requires_grad')  # C: no Python frame per parameter
SWITCH = ("model_wrapper_cfg=dict(type='MMDistributedDataParallel', "
          'find_unused_parameters=True)')


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """``id()`` of every leaf tensor the autograd graph of ``loss`` accumulates into.

    Nodes are marked seen as they are pushed (each is read once), and only nodes without
    inputs are asked for a ``variable`` (``AccumulateGrad`` holds its leaf; asking any
    other node raises inside ``getattr``): 2.7x faster than a plain walk on a 12-block GPT.
    """
    root = loss.grad_fn
    if root is None:
        return set()
    reached: set[int] = set()
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        inputs = node.next_functions
        if not inputs:
            variable = getattr(node, 'variable', None)
            if variable is not None:
                reached.add(id(variable))
            continue
        for child, _ in inputs:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return reached


def _listed(names: Sequence[str]) -> str:
    return ', '.join(names[:5]) + (f' and {len(names) - 5} more' if len(names) > 5 else '')


# Every rank walks the graph on its first backwards and every FULL_CHECK_PERIOD-th;
# in between, a rank walks it when its size changed.
FIRST_FULL_CHECKS = 3
FULL_CHECK_PERIOD = 50


class UsedParameters:
    """Checks that every rank's loss reaches the same trainable parameters.

    The ranks compare the parameters their losses reach with one small
    all-reduce on the first backward of each set of trainable parameters
    (GANs switch ``requires_grad``) and record the set every rank used. Later
    backwards compare this rank's set with that record, without a
    collective, by a walk of the autograd graph (0.03 ms for the benchmark
    GPT, 0.2 ms for 24 blocks, eager). Nothing in a backward reads all parameters
    (after a forward that alone costs ~0.5 us per parameter in cache misses).
    Every rank walks on its first :data:`FIRST_FULL_CHECKS` backwards and
    every :data:`FULL_CHECK_PERIOD`-th, the same backwards on every rank, so
    a new set of trainable parameters is agreed on there. In between, a rank
    walks when the number of autograd nodes built since its previous loss
    differs from the time before (a skipped branch or head; free to read,
    :func:`~mmengine_deepspeed.compat.autograd_sequence_number`); the
    periodic walk catches what the count cannot (routing between branches
    of one size). A rank that differs raises at once; its peers, waiting in
    DeepSpeed's reduction, fail as soon as its process ends (launchers end
    the others). Parameters no rank ever uses are fine; like DDP without
    ``find_unused_parameters``, parameters that every rank stops using at
    once are reported too.
    """

    def __init__(self) -> None:
        self._agreed: dict[tuple[bool, ...], frozenset[str]] = {}
        self._backwards = 0
        self._number: Optional[int] = None  # the previous loss's autograd sequence number
        self._span: Optional[int] = None  # autograd nodes built between the last two losses

    def check(self, loss: torch.Tensor, names: Sequence[str],
              params: Sequence[nn.Parameter]) -> None:
        """Raise if this rank's ``loss`` reaches other trainable parameters than agreed.

        Args:
            loss (torch.Tensor): This rank's loss, before backward.
            names (Sequence[str]): The model's parameters' names, in the
                same order on every rank.
            params (Sequence[nn.Parameter]): The parameters of ``names``.
        """
        self._backwards += 1
        every_rank = (self._backwards <= FIRST_FULL_CHECKS
                      or self._backwards % FULL_CHECK_PERIOD == 0)
        if not self._graph_changed(autograd_sequence_number(loss)) and not every_rank:
            return
        trainable = tuple(map(_REQUIRES_GRAD, params))
        agreed = self._agreed.get(trainable)
        if agreed is None and not every_rank:
            return  # a new trainable set: agreed on at the next walk every rank takes
        reached = reached_parameters(loss)
        named = [(name, p) for name, p, grad in zip(names, params, trainable) if grad]
        names = [name for name, _ in named]
        used = frozenset(name for name, p in named if id(p) in reached)
        if agreed is None:
            self._agreed[trainable] = self._agree(names, used)
        elif used != agreed:
            raise RuntimeError(
                'In this iteration this rank used other parameters than every rank used before '
                f'(now unused: {_listed([n for n in names if n in agreed - used]) or "none"}; '
                f'now used: {_listed([n for n in names if n in used - agreed]) or "none"}), and '
                'DeepSpeed can only reduce '
                'gradients that every rank produces. If the model skips parts of itself '
                'depending on the data (a branch, a head without positive samples), set '
                f'{SWITCH} in the config, as for DDP.')

    def _graph_changed(self, number: Optional[int]) -> bool:
        """Whether the graph built since the previous loss has another size than before."""
        span = None if number is None or self._number is None else number - self._number
        changed = span is None or span != self._span
        self._number, self._span = number, span
        return changed

    @staticmethod
    def _agree(names: list[str], used: frozenset[str]) -> frozenset[str]:
        counts = torch.tensor([name in used for name in names], dtype=torch.int32)
        dist.all_reduce(counts, group=cpu_group())
        world = dist.get_world_size()
        partly = [name for name, count in zip(names, counts.tolist()) if 0 < count < world]
        if partly:
            raise RuntimeError(
                f'In this iteration some ranks used parameters that others did not '
                f'({_listed(partly)}); DeepSpeed can only reduce gradients that every rank '
                'produces. If the model skips parts of itself depending on the data (a branch, '
                f'a head without positive samples), set {SWITCH} in the config, as for DDP.')
        return used


class _AllGradients(torch.autograd.Function):
    """A zero whose backward computes the real loss's gradients and returns them all at once.

    Autograd then accumulates every parameter's gradient from this one node,
    in an order that depends only on the parameter list (the same on every
    rank), and DeepSpeed's reduction hooks fire in that order.
    """

    @override
    @staticmethod
    def forward(ctx: Any, holder: list, *params: torch.Tensor) -> torch.Tensor:
        ctx.holder = holder  # [loss, params, retain_graph], kept out of this node's graph
        return params[0].new_zeros((), dtype=torch.float32)

    @override
    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple:
        loss, params, retain_graph = ctx.holder
        ctx.holder = None
        # upstream is what DeepSpeed multiplied the loss by: the fp16 loss
        # scale, or 1. Passing it on (in fp32: 2**16 does not fit in fp16)
        # scales the gradients exactly as a direct backward of the loss would.
        grads = torch.autograd.grad(loss.float(), params, grad_outputs=upstream.float(),
                                    retain_graph=retain_graph, allow_unused=True)
        return (None, *(torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)))


def with_every_parameter(loss: torch.Tensor, params: Sequence[nn.Parameter],
                         retain_graph: bool) -> torch.Tensor:
    """A loss whose backward gives every parameter its gradient of ``loss`` (zero if unused).

    Args:
        loss (torch.Tensor): This rank's (accumulation-scaled) loss.
        params (Sequence[nn.Parameter]): The trainable parameters, in the
            same order on every rank.
        retain_graph (bool): Keep the graph of ``loss``.

    Returns:
        torch.Tensor: A zero-valued scalar to pass to ``engine.backward``.
    """
    if not params:
        return loss
    return _AllGradients.apply([loss, list(params), retain_graph], *params)


def zero3_unsupported(stage: int) -> Optional[str]:
    """Why ``find_unused_parameters`` cannot be honoured at ``stage``, or None.

    ZeRO-3 gathers a module's partitioned parameters (a collective) when the
    module runs and gives a gradient the full shape only while they are
    gathered, so a module that one rank skips cannot get its zero gradient
    there without a collective the other ranks are not in. Many OpenMMLab
    configs set the switch by default, so the runner warns and checks instead
    of refusing.

    Args:
        stage (int): The ZeRO stage of the engine about to be built.
    """
    if stage != 3:
        return None
    return (f'{SWITCH} cannot be honoured under ZeRO-3 (a module that only some ranks run '
            'leaves the others out of the gather of its parameters); every rank must use the '
            'same parameters in each iteration, which is checked. For models that skip '
            'parameters, use zero_optimization.stage=2 (with offload_optimizer for memory).')


def untrace_parameterless_modules(engine: Any) -> int:
    """Take a ZeRO-3 engine's hooks off its submodules without parameters.

    DeepSpeed hooks every submodule to gather, release and prefetch its
    parameters, and records their order, which must be the same on every
    rank; a module without parameters (its own or its children's) needs none
    of it. Data-dependent calls of such modules (loss modules skipped on a rank
    without positive samples) then no longer differ between ranks' records.

    Args:
        engine (DeepSpeedEngine): The engine, just built.

    Returns:
        int: How many hooks were removed (0 below ZeRO-3).
    """
    dicts = {id(d) for module in engine.module.modules()
             if module is not engine.module and next(module.parameters(), None) is None
             for d in module_hook_dicts(module)}
    removed = 0
    for handle in zero3_module_hooks(engine):
        if id(hook_dict_of(handle)) in dicts:
            handle.remove()
            removed += 1
    return removed
