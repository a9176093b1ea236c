"""Parameters that some ranks do not use in an iteration (conditional branches, routing).

DeepSpeed reduces a gradient when autograd produces it, one collective per
bucket slice, in the order gradients become ready. A rank whose forward
skipped a parameter produces no gradient for it, so the ranks' sequences of
collectives differ: ZeRO-1/2 abort in gloo ("Received data size doesn't
match") or average the wrong slices, ZeRO-3 waits until the process-group
timeout. MMEngine users meet the same models under DDP with
``model_wrapper_cfg=dict(find_unused_parameters=True)``; that switch does the
following here:

* the loss's gradients are computed with ``torch.autograd.grad`` (no
  DeepSpeed hook fires), a skipped parameter's gradient is zero;
* the gradients are then handed to DeepSpeed's backward through one small
  graph that is the same on every rank (each parameter receives its gradient
  from its own node), so the ranks reduce the same tensors in the same order:
  DDP's math, the average over all ranks with zeros from those that skipped.

Without the switch, every iteration on more than one rank checks which
trainable parameters the loss reaches (a walk of the autograd graph and one
small all-reduce) and raises, naming the parameters and the switch, before
DeepSpeed's reduction could abort or hang.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SWITCH = ("model_wrapper_cfg=dict(type='MMDistributedDataParallel', "
          'find_unused_parameters=True)')


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """``id()`` of every leaf tensor the autograd graph of ``loss`` accumulates into."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, 'variable', None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return reached


_CPU_GROUPS: dict[int, Any] = {}


def _cpu_group() -> Any:
    """A gloo group over all ranks, for the check's small all-reduce of CPU data.

    The mask is built on the CPU; sending it through NCCL would make the
    CPU wait for the GPU's queued forward pass before launching backward.
    Created once per default group (collectively, at the first check, which
    every rank reaches in the same iteration).
    """
    world = dist.group.WORLD
    if dist.get_backend() == 'gloo':
        return world
    key = id(world)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend='gloo')
    return _CPU_GROUPS[key]


def check_same_parameters_used(loss: torch.Tensor,
                               named_params: Sequence[tuple[str, nn.Parameter]]) -> None:
    """Raise when the ranks' losses reach different trainable parameters (collective).

    Args:
        loss (torch.Tensor): This rank's loss, before backward.
        named_params (Sequence[tuple[str, nn.Parameter]]): The trainable
            parameters, in the same order on every rank.
    """
    reached = reached_parameters(loss)
    used = torch.tensor([id(p) in reached for _, p in named_params], dtype=torch.int32)
    dist.all_reduce(used, group=_cpu_group())
    world = dist.get_world_size()
    partly = [name for (name, _), count in zip(named_params, used.tolist()) if 0 < count < world]
    if partly:
        shown = ', '.join(partly[:5]) + (f' and {len(partly) - 5} more' if len(partly) > 5 else '')
        raise RuntimeError(
            f'In this iteration some ranks used parameters that others did not ({shown}); '
            'DeepSpeed cannot reduce such gradients. If the model skips parts of itself '
            f'depending on the data (a branch, a head without positive samples), set {SWITCH} '
            'in the config, as for DDP.')


class _AllGradients(torch.autograd.Function):
    """A zero whose backward computes the real loss's gradients and returns them all at once.

    Autograd then accumulates every parameter's gradient from this one node,
    in an order that depends only on the parameter list (the same on every
    rank), and DeepSpeed's reduction hooks fire in that order.
    """

    @staticmethod
    def forward(ctx: Any, holder: list, *params: torch.Tensor) -> torch.Tensor:
        ctx.holder = holder  # [loss, params, retain_graph], kept out of this node's graph
        return params[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple:
        loss, params, retain_graph = ctx.holder
        ctx.holder = None
        # upstream is what DeepSpeed multiplied the loss by: the fp16 loss
        # scale, or 1. Passing it on scales the gradients exactly as a
        # direct backward of the loss would.
        # in fp32: a 2**16 loss scale does not fit in fp16
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
    return _AllGradients.apply([loss, list(params), retain_graph], *params)


def check_find_unused_supported(stage: int) -> None:
    """Refuse ``find_unused_parameters`` under ZeRO-3, before the engine is built.

    ZeRO-3 gathers a module's partitioned parameters (a collective) when the
    module runs and gives each gradient the full shape only while they are
    gathered, so a module that one rank skips cannot get its zero gradient
    there without a collective the other ranks are not in.

    Args:
        stage (int): The ZeRO stage of the engine about to be built.
    """
    if stage == 3:
        raise ValueError(
            f'{SWITCH} is supported with ZeRO stages 0-2: under ZeRO-3 a module that only some '
            'ranks run leaves the others out of the gather of its parameters. Use '
            'zero_optimization.stage=2 (with offload_optimizer for memory), or make every rank '
            'run every module (e.g. multiply an unused branch\'s output by 0).')
