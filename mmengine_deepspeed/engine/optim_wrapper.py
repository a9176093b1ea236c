"""DeepSpeedOptimWrapper: MMEngine's optimizer-wrapper interface over an engine.

MMEngine's loops, hooks and schedulers talk to an ``OptimWrapper``; DeepSpeed
wants ``engine.backward`` and ``engine.step``. This wrapper keeps MMEngine's
semantics exactly, so a config behaves as it did without DeepSpeed:

* gradient accumulation: parameters change every ``accumulative_counts``
  iterations, the loss is divided as MMEngine divides it (including the shorter
  last window when ``max_iters`` is not a multiple), and the engine is told
  where each accumulation boundary is rather than counting on its own;
* the learning rate and momentum live in the param groups of the optimizer
  MMEngine built, which DeepSpeed's ZeRO optimizers step with, so
  ``param_scheduler`` and ``LoggerHook`` work unchanged;
* clipping is DeepSpeed's ``gradient_clipping`` (global L2 norm over every
  partition); the norm, the count of skipped (non-finite) updates and under fp16
  the loss scale are published to the message hub for the logger;
* a step whose loss or gradients are not finite is skipped on every rank, at
  every stage and precision (``engine/nonfinite.py``).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import mmengine.runner  # noqa: F401  registers MMEngine's same-named wrapper first (see below)
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from ..compat import (
    accumulative_counts,
    backward_counts,
    backward_prologue,
    count_backward,
    end_interrupted_backward,
    set_backward_counts,
)
from ..zero.unused_params import UsedParameters, with_every_parameter
from .nonfinite import StepCheck, guard_loss


# force=True: importing mmengine.runner (done above, so that the order is
# fixed) imports mmengine._strategy.deepspeed, which registers its own
# DeepSpeedOptimWrapper under this name, part of the DeepSpeedStrategy that
# does not work on DeepSpeed 0.19; configs written for it get this one.
@OPTIM_WRAPPERS.register_module(force=True)
class DeepSpeedOptimWrapper(OptimWrapper):
    """Optimizer wrapper whose backward and step go through a DeepSpeed engine.

    The runner builds it; in a config, ``optim_wrapper.type`` may stay
    ``'OptimWrapper'`` or say ``'DeepSpeedOptimWrapper'``.

    Args:
        engine (DeepSpeedEngine): The engine that owns the model.
        optimizer (Optimizer): The optimizer MMEngine built and handed to
            ``deepspeed.initialize``; its param groups are the ones DeepSpeed
            steps with.
        accumulative_counts (int): Backwards per parameter update (iterations times
            ``micro_steps``). Defaults to 1.
        clip_max_norm (float): DeepSpeed's ``gradient_clipping`` (0 for none),
            used only to decide whether a grad norm is logged when the engine
            does not compute one. Defaults to 0.
        find_unused_parameters (bool): Let ranks use different parameters
            in an iteration (DDP's option of that name; see ``zero/unused_params.py``).
            Without it, such an iteration on several ranks raises.
            Defaults to False.
        name (str, optional): The key of this wrapper in an
            ``OptimWrapperDict`` (a model with several optimizers); its grad
            norm and loss scale are logged as ``train/<name>.grad_norm``,
            next to MMEngine's ``<name>.lr``. Defaults to None.
        forward_through_engine (bool): Whether the losses come from
            ``engine.forward``; False when the model calls its (sub)modules
            itself (its own ``train_step``, several engines), and the engine's
            backward is then started here (see :func:`begin_backward_at`).
            Defaults to True.
        micro_steps (int): Backwards per iteration: a layout's virtual ranks on this rank
            (``config/layout.py``), each one micro-step. Defaults to 1.
    """

    def __init__(self, engine: DeepSpeedEngine, optimizer: Optimizer,
                 accumulative_counts: int = 1, clip_max_norm: float = 0.0,
                 find_unused_parameters: bool = False, name: Optional[str] = None,
                 forward_through_engine: bool = True, micro_steps: int = 1):
        super().__init__(optimizer, accumulative_counts=accumulative_counts)
        self.forward_through_engine = forward_through_engine
        self.micro_steps = micro_steps
        self._log_prefix = f'train/{name}.' if name else 'train/'
        # the message hub key of this wrapper's count of skipped (non-finite) updates
        self.skipped_steps_key = f'{self._log_prefix}skipped_steps'
        self.engine = engine
        self.clip_max_norm = clip_max_norm
        self.find_unused_parameters = find_unused_parameters
        self._used_parameters = UsedParameters()
        self._several_ranks = dist.is_initialized() and dist.get_world_size() > 1
        self._named: Optional[tuple[list[str], list[nn.Parameter]]] = None
        self.step_check = StepCheck(engine)
        # fixed once the engine is built, so read once, not per update: fp16 (a loss scale
        # to log), and ZeRO-0 fp32 with clipping (DeepSpeed reports no grad norm)
        self._fp16 = engine.fp16_enabled()
        self._own_norm = clip_max_norm > 0 and not (
            engine.zero_optimization() or self._fp16 or engine.bfloat16_enabled())
        # hold_step(): the boundary's reduction and update wait (engine/split_retry.py)
        self._holding = False
        self._held: Optional[dict] = None  # the held update's step kwargs

    def hold_step(self) -> None:
        """Until :meth:`release_step` or :meth:`drop_step`, the accumulation boundary's
        reduction and update wait: its backward runs as a non-boundary one (under ZeRO-0/1
        nothing reduces then) and its ``step`` is kept. For an iteration that every rank
        must first agree ran (``engine/split_retry.py``)."""
        self._holding, self._held = True, None

    def release_step(self) -> None:
        """Reduce and update as the held boundary would have (nothing if the iteration
        had none): ``engine.allreduce_gradients`` at the boundary is what the boundary's
        backward runs."""
        held, self._holding, self._held = self._held, False, None
        if held is None:
            return
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.allreduce_gradients()
        self.step(**held)

    def drop_step(self, counted: int) -> None:
        """Drop the gradients accumulated since the held iteration began (the first of an
        accumulation window: there are no others) and count backwards from ``counted``
        again, as before it."""
        self._holding, self._held = False, None
        end_interrupted_backward(self.engine.optimizer)
        self.zero_grad()
        set_backward_counts(self, accumulative_counts(self), counted, backward_counts(self)[1])

    def set_micro_steps(self, micro_steps: int) -> None:
        """Count ``micro_steps`` backwards per iteration from now on (between iterations:
        a batch split into more micro-batches, ``engine/split_retry.py``): MMEngine's
        counts, kept in backwards, stand for the same iterations."""
        counted, maximum = backward_counts(self)
        per, self.micro_steps = self.micro_steps, micro_steps
        set_backward_counts(self, accumulative_counts(self) // per * micro_steps,
                            counted // per * micro_steps,
                            maximum // per * micro_steps if maximum > 0 else maximum)

    @override
    def initialize_count_status(self, model: nn.Module, init_counts: int,
                                max_counts: int) -> None:
        """MMEngine's, counted in backwards: the loops give iterations, and an iteration of
        a layout is :attr:`micro_steps` backwards."""
        super().initialize_count_status(model, init_counts * self.micro_steps,
                                        max_counts * self.micro_steps)

    @override
    def update_params(self, loss: torch.Tensor, step_kwargs: Optional[dict] = None,
                      zero_kwargs: Optional[dict] = None) -> None:
        """Scale the loss, back-propagate and step the engine.

        The engine is stepped after every backward, as DeepSpeed requires;
        it changes the parameters only at the accumulation boundary that
        :meth:`backward` announced.

        Args:
            loss (torch.Tensor): The loss of this iteration.
            step_kwargs (dict, optional): Passed to ``engine.step``.
                Defaults to None.
            zero_kwargs (dict, optional): Must be empty: the engine clears
                gradients itself. Defaults to None.
        """
        if zero_kwargs:
            raise ValueError(
                f'zero_kwargs={zero_kwargs} cannot be honoured: DeepSpeed clears gradients '
                'itself after each update.')
        self.backward(self.scale_loss(loss))
        self.step(**(step_kwargs or {}))

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (already scaled) through the engine.

        Args:
            loss (torch.Tensor): Scaled loss, as from :meth:`scale_loss`.
            **kwargs: ``retain_graph`` is passed on; nothing else is accepted.
        """
        if kwargs and set(kwargs) - {'retain_graph'}:
            raise TypeError('DeepSpeedOptimWrapper.backward() got unsupported '
                            f'{sorted(set(kwargs) - {"retain_graph"})}.')
        # should_sync() answers "does this backward end an accumulation
        # window", MMEngine's rule; the engine reduces and steps on it (unless held).
        boundary = self.should_sync()
        self.engine.set_gradient_accumulation_boundary(boundary and not self._holding)
        if boundary and self._holding:
            self._held = {}
        retain_graph = kwargs.get('retain_graph', False)
        loss = guard_loss(loss)
        if self.find_unused_parameters:
            loss = with_every_parameter(
                loss, [p for p in self._parameters()[1] if p.requires_grad], retain_graph)
        elif self._several_ranks:
            self._used_parameters.check(loss, *(self._named or self._parameters()))
        if not self.forward_through_engine:
            loss = begin_backward_at(loss, self.engine)
        self.engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)
        count_backward(self)

    def _parameters(self) -> tuple[list[str], list[nn.Parameter]]:
        """The engine's parameters' names and parameters: fixed once it is built; which of
        them are trainable is not (GANs toggle ``requires_grad`` between their steps)."""
        if self._named is None:
            named = list(self.engine.module.named_parameters())
            self._named = ([name for name, _ in named], [p for _, p in named])
        return self._named

    @override
    def step(self, **kwargs: Any) -> None:
        """Step the engine; at a boundary this updates and logs the grad norm.

        Args:
            **kwargs: Passed to ``engine.step`` (``lr_kwargs``).
        """
        if self._held is not None and self._holding:  # the held boundary's: kept
            self._held = kwargs
            return
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step(**kwargs)
            return
        fallback_norm = self._norm_if_engine_does_not() if self._own_norm else None
        self.step_check.before_step(fallback_norm)
        try:
            self.engine.step(**kwargs)
        finally:
            skipped_on_host, skipped_count = self.step_check.after_step()
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = fallback_norm
        # a skipped update's norm (inf) would hold the log's window mean at inf; where the
        # skip is known on the host it is left out (a device-side skip's is logged)
        if norm is not None and not skipped_on_host:
            self.message_hub.update_scalar(f'{self._log_prefix}grad_norm', norm)
        if self._fp16:
            self.message_hub.update_scalar(f'{self._log_prefix}loss_scale',
                                           float(self.engine.optimizer.loss_scale))
        self.message_hub.update_scalar(self.skipped_steps_key, skipped_count)

    def _norm_if_engine_does_not(self) -> Optional[torch.Tensor]:
        """The grad norm for ZeRO-0 fp32 with clipping (``_own_norm``), which DeepSpeed
        does not report.

        Under ZeRO-0 the gradients are complete and all-reduced by the end of
        the boundary backward, so the norm is the same on every rank. Where
        the runner switched the engine's clipping off (0-dim parameters, see
        zero/zero_dim.py) the gradients are clipped here, as DeepSpeed would:
        ``min(1, max_norm / (norm + 1e-6))``.
        """
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        if not params:
            return None
        if self.engine.gradient_clipping() == 0:
            return torch.nn.utils.clip_grad_norm_(params, self.clip_max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    @override
    def zero_grad(self, **kwargs: Any) -> None:
        """Clear gradients through DeepSpeed (it also does so after each update)."""
        inner = self.engine.optimizer
        if inner is not None and hasattr(inner, 'zero_grad'):
            inner.zero_grad(**kwargs)
        else:
            self.engine.zero_grad()

    @override
    def state_dict(self) -> dict:
        """Refused: under ZeRO each rank holds only its partition of the state.

        Optimizer state is saved and resumed with the engine, by the runner's
        ``save_checkpoint`` / ``resume``.
        """
        raise RuntimeError(
            'DeepSpeedOptimWrapper.state_dict() would return one rank\'s partition only; '
            'optimizer state is saved and resumed with the engine (runner.save_checkpoint / '
            'resume).')

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        """Refused, as :meth:`state_dict`."""
        raise RuntimeError(
            'DeepSpeedOptimWrapper.load_state_dict() is not supported; resume the runner from '
            'a checkpoint directory instead.')

    @override
    def optim_context(  # type: ignore[override]
            self, model: nn.Module) -> AbstractContextManager[None]:
        """No-op: DeepSpeed decides when gradients are reduced.

        MMEngine's version enters ``model.no_sync()`` between boundaries,
        which DeepSpeed refuses under ZeRO-2/3 and does not need. One shared
        ``nullcontext`` (MMEngine types its own as a generator's context manager;
        ``with`` takes any): no generator is made per iteration.
        """
        return _NO_CONTEXT


_NO_CONTEXT = nullcontext()


def begin_backward_at(loss: torch.Tensor, engine: DeepSpeedEngine) -> torch.Tensor:
    """Start ``engine``'s backward bookkeeping from ``loss``, as ``engine.forward`` would.

    DeepSpeed 0.19 resets a ZeRO optimizer's gradient-hook counters in
    ``engine.forward`` and runs the engine's backward prologue (ZeRO's
    ``enter_backward`` and its post-backward callback) from hooks it puts on
    the forward's outputs. A model that calls its submodules directly (several
    engines, or its own ``train_step``) gets neither, and ZeRO-3 then reduces
    accumulated gradients wrongly. The same two calls are made here, the
    prologue from a hook on the loss so that it runs inside the backward as
    DeepSpeed's does; ``engine._backward_prologue`` is private, no public API
    runs it, and ZeRO-3 with accumulation against MMEngine's Runner pins it
    (tests/dist/test_gan.py; ``parity_custom_step_zero3_accum2`` in
    tests/dist/test_train.py fails without it). ZeRO-0 engines need neither.

    Args:
        loss (torch.Tensor): The loss about to go to ``engine.backward``.
        engine (DeepSpeedEngine): The engine that owns the stepped optimizer.

    Returns:
        torch.Tensor: ``loss``.
    """
    if isinstance(engine.optimizer, ZeROOptimizer) and loss.requires_grad:
        engine.optimizer.clear_backward_seen_flag()

        def prologue(grad: torch.Tensor) -> torch.Tensor:
            backward_prologue(engine)
            return grad

        loss.register_hook(prologue)
    return loss
