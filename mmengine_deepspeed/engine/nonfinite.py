"""Non-finite steps never reach the weights, at every ZeRO stage and precision.

What DeepSpeed already does, and what is added here:

* **ZeRO-1/2/3, and bf16/fp16 at any stage**: DeepSpeed's optimizer computes the
  global grad norm (an all-reduce over ranks) and skips the update when it is not
  finite; ``engine.skipped_steps`` counts it. Nothing is added but the count in the
  log, for every precision (:meth:`StepCheck.after_step`).
* **ZeRO-0 in fp32**: the torch optimizer is stepped as it is, and one NaN reaches
  every rank's weights through the gradient all-reduce. :class:`StepCheck` decides
  from the norm of the reduced gradients (the same on every rank): an optimizer
  PyTorch can skip on the device (``fused=True``: AdamW, Adam, SGD, Adagrad) gets
  ``found_inf`` as ``torch.amp.GradScaler`` gives it, without a host read; any other
  reads the decision on the host once per update, as ``GradScaler`` does for it,
  and a skipped update has every gradient set to ``None`` by a step pre-hook (after
  DeepSpeed's clipping, which needs them), which torch optimizers step over: no
  parameter or state changes.
* **A non-finite loss with finite gradients** (a NaN added to a loss, a detached
  term) would still be applied everywhere: :func:`guard_loss` makes the gradient
  that flows back from a non-finite loss NaN, on the device, so the check above
  (DeepSpeed's or ours) skips that step on every rank.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from deepspeed import DeepSpeedEngine

from ..compat import found_inf_supported


def guard_loss(loss: torch.Tensor) -> torch.Tensor:
    """Make the gradients of a non-finite ``loss`` non-finite (on the device; no read).

    The loss is multiplied by ``d - d + 1`` of its detached value ``d``: exactly 1 for a
    finite value (``x - x`` is 0 in IEEE arithmetic), NaN for an Inf or a NaN. So a
    finite loss's value and gradient pass unchanged, bit for bit, in its own dtype, and
    nothing runs in Python during backward (a gradient hook would call back into Python
    at every backward).

    Args:
        loss (torch.Tensor): The loss about to be back-propagated.

    Returns:
        torch.Tensor: What to back-propagate: ``loss`` itself if it needs no gradient.
    """
    if not loss.requires_grad:
        return loss
    value = loss.detach()
    return loss * (value - value + 1)


class StepCheck:
    """Skips an engine's non-finite updates where DeepSpeed does not, and counts all.

    Args:
        engine (DeepSpeedEngine): The engine whose updates are checked.
    """

    def __init__(self, engine: DeepSpeedEngine):
        self.engine = engine
        # ZeRO-0 fp32: DeepSpeed steps the torch optimizer as it is.
        self.ours = not (engine.zero_optimization() or engine.fp16_enabled()
                         or engine.bfloat16_enabled())
        self._skipped: Optional[torch.Tensor] = None  # ours on the device (fused optimizer)
        self._host_skips = 0  # ours decided on the host (an unfused optimizer)
        self._before = 0
        self._drop_grads = False
        if self.ours and not found_inf_supported(engine.optimizer):
            engine.optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook: a skipped update's gradients are dropped here,
        after DeepSpeed clipped them (its clipping fails without any)."""
        if self._drop_grads:
            self._drop_grads = False
            for group in optimizer.param_groups:
                for p in group['params']:
                    p.grad = None

    def before_step(self, norm: Optional[torch.Tensor]) -> None:
        """Arrange for the coming update (a boundary) to be skipped if its gradients are
        not finite: ZeRO-0 fp32 only, where DeepSpeed does not check.

        Args:
            norm (torch.Tensor, optional): The gradients' global norm, if computed
                already (for clipping); computed here otherwise.
        """
        self._before = int(self.engine.skipped_steps) + self._host_skips
        if not self.ours:
            return
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        if not params:
            return
        if norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        bad = torch.logical_not(torch.isfinite(norm))
        optimizer = self.engine.optimizer
        if found_inf_supported(optimizer):
            optimizer.found_inf = bad.float()  # read by the fused kernels: no host read
            self._skipped = bad.long() if self._skipped is None else self._skipped + bad
        elif bool(bad):  # the one host read per update a non-fused optimizer needs
            self._host_skips += 1
            self._drop_grads = True

    def after_step(self) -> tuple[bool, Union[torch.Tensor, float]]:
        """Take back what :meth:`before_step` gave the optimizer.

        Returns:
            tuple[bool, torch.Tensor | float]: Whether the update is known on the host to
            have been skipped (DeepSpeed's checks, or ours with an unfused optimizer; not
            ours on the device), and the skipped updates so far to publish
            (:meth:`_published`).
        """
        if self.ours:
            optimizer = self.engine.optimizer
            if hasattr(optimizer, 'found_inf'):
                del optimizer.found_inf
        known = int(self.engine.skipped_steps) + self._host_skips
        return known > self._before, self._published(known)

    def count_now(self) -> float:
        """The skipped updates so far as a number (a host read where ours are counted on
        the device: for the start of ``train()``, not for every iteration)."""
        return float(self._published(int(self.engine.skipped_steps) + self._host_skips))

    def _published(self, known: int) -> Union[torch.Tensor, float]:
        """Skipped updates so far: DeepSpeed's count plus ours (``known`` on the host; a
        device tensor, read when the message hub is, where a fused optimizer skipped on
        the device)."""
        return float(known) if self._skipped is None else self._skipped + known

