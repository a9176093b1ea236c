"""LARS and LAMB as MMPretrain 1.x computes them, for tests without MMPretrain installed.

``RefLARS`` and ``RefLamb`` state MMPretrain's ``LARS`` and ``Lamb`` (timm's) math on whole
parameters, one parameter at a time; importing this module registers them in MMEngine's
``OPTIMIZERS`` and in ``NORM_MATH``, so DeepSpeedRunner steps them per parameter on ZeRO's
partitions as it does MMPretrain's. At ZeRO-0 in fp32 their own ``step`` runs: the reference.
The real-client tier runs MMPretrain's own classes (BYOL's LARS).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from mmengine.registry import OPTIMIZERS
from torch.optim import Optimizer

from mmengine_deepspeed.engine.norm_optimizers import NORM_MATH


@OPTIMIZERS.register_module()
class RefLARS(Optimizer):
    """Layer-wise adaptive rate scaling on SGD with momentum (MMPretrain's ``LARS``)."""

    def __init__(self, params: Any, lr: float, momentum: float = 0, weight_decay: float = 0,
                 dampening: float = 0, eta: float = 0.001, nesterov: bool = False,
                 eps: float = 1e-8):
        self.eps = eps
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, eta=eta))

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:
                    continue
                local_lr = 1.0
                if not group.get('lars_exclude', False):
                    w, g = torch.norm(p).item(), torch.norm(p.grad).item()
                    if w != 0 and g != 0:
                        local_lr = group['eta'] * w / (g + group['weight_decay'] * w + self.eps)
                step = p.grad.add(p, alpha=group['weight_decay']).mul(local_lr * group['lr'])
                if group['momentum'] != 0:
                    state = self.state[p]
                    if 'momentum_buffer' not in state:
                        state['momentum_buffer'] = step.clone()
                    else:
                        state['momentum_buffer'].mul_(group['momentum']).add_(
                            step, alpha=1 - group['dampening'])
                    buf = state['momentum_buffer']
                    step = step.add(buf, alpha=group['momentum']) if group['nesterov'] else buf
                p.sub_(step)


@OPTIMIZERS.register_module()
class RefLamb(Optimizer):
    """LAMB with a global gradient-norm clip (MMPretrain's / timm's ``Lamb``)."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 grad_averaging: bool = True, max_grad_norm: float = 1.0,
                 trust_clip: bool = False, always_adapt: bool = False):
        super().__init__(params, dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
            weight_decay=weight_decay, grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm, trust_clip=trust_clip, always_adapt=always_adapt))

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g['params'] if p.grad is not None]
        total = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
        max_norm = self.defaults['max_grad_norm']
        clip = total / max_norm if total > max_norm else torch.ones(())
        for group in self.param_groups:
            beta1, beta2 = group['betas']
            beta3 = 1 - beta1 if group['grad_averaging'] else 1.0
            group['step'] = group.get('step', 0) + 1
            c1, c2 = ((1 - beta1 ** group['step'], 1 - beta2 ** group['step'])
                      if group['bias_correction'] else (1.0, 1.0))
            for p in group['params']:
                if p.grad is None:
                    continue
                grad = p.grad.div_(clip)
                state = self.state[p]
                if not state:
                    state['exp_avg'] = torch.zeros_like(p)
                    state['exp_avg_sq'] = torch.zeros_like(p)
                state['exp_avg'].mul_(beta1).add_(grad, alpha=beta3)
                state['exp_avg_sq'].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state['exp_avg_sq'].sqrt() / math.sqrt(c2)).add_(group['eps'])
                update = (state['exp_avg'] / c1).div_(denom)
                if group['weight_decay'] != 0:
                    update.add_(p, alpha=group['weight_decay'])
                if group['weight_decay'] != 0 or group['always_adapt']:
                    w, u = p.norm(2.0), update.norm(2.0)
                    trust = w / u if w > 0 and u > 0 else torch.ones(())
                    if group['trust_clip']:
                        trust = torch.clamp(trust, max=1.0)
                    update.mul_(trust)
                p.add_(update, alpha=-group['lr'])


NORM_MATH[f'{__name__}.RefLARS'] = 'lars'
NORM_MATH[f'{__name__}.RefLamb'] = 'lamb'


@OPTIMIZERS.register_module()
class UnknownLARS(RefLARS):
    """RefLARS under a name DeepSpeedRunner does not know: stepped on the flat partitions as
    DeepSpeed steps any optimizer (with ``zero_allow_untested_optimizer``), the bug."""
