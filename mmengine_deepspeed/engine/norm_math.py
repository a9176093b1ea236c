"""The math of the norm-reading optimizers on ZeRO's partitions (``norm_optimizers.py``):
MMPretrain's LARS and Lamb, each as the steps :class:`~.norm_optimizers.PartitionedNormStep`
takes: ``before`` (what needs no collective), which groups are ``scaled`` by a norm, what is
``normed`` per slice, the ``scales`` from the reduced norms, and how a slice is stepped.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: norm_optimizers imports this module
    from .norm_optimizers import Call, PartitionedNormStep


def setting(owner: PartitionedNormStep, items: list[Call], key: str, default: Any,
             device: torch.device) -> torch.Tensor:
    """A param-group setting with one value per slice of the call."""
    values = tuple(float(c.group.get(key, default)) for c in items)
    if values not in owner.settings:
        owner.settings[values] = torch.tensor(values, dtype=torch.float64, device=device)
    return owner.settings[values]


class Lars:
    """MMPretrain's LARS: ``local_lr = eta * |w| / (|g| + wd * |w| + eps)`` per parameter
    (1 where either norm is 0 or the group has ``lars_exclude``), then SGD with momentum
    on ``(g + wd * w) * lr * local_lr``."""

    @staticmethod
    def before(owner: PartitionedNormStep, items: list[Call]) -> dict[str, torch.Tensor]:
        return {}

    @staticmethod
    def scaled(group: dict) -> bool:
        return not group.get('lars_exclude', False)

    @staticmethod
    def normed(owner: PartitionedNormStep, call: Call,
               norms: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return call.weight(), call.grad()

    @staticmethod
    def scales(owner: PartitionedNormStep, items: list[Call],
               reduced: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        weight, grad = reduced
        eta, decay, exclude = (setting(owner, items, key, default, weight.device)
                               for key, default in (('eta', 0.001), ('weight_decay', 0.0),
                                                    ('lars_exclude', False)))
        local = eta * weight / (grad + decay * weight + getattr(owner.optimizer, 'eps', 1e-8))
        use = (weight != 0) & (grad != 0) & (exclude == 0)
        return {'local_lr': torch.where(use, local, torch.ones_like(local))}

    @staticmethod
    def apply(owner: PartitionedNormStep, call: Call, norms: dict[str, torch.Tensor],
              index: int, fresh: bool) -> None:
        group, weight = call.group, call.weight()
        lr = group['lr']
        if 'local_lr' in norms:
            lr = (norms['local_lr'][index] * lr).float()
        step = call.grad().add(weight, alpha=group['weight_decay']).mul(lr)
        momentum = group['momentum']
        if momentum != 0:
            buf = call.state('momentum_buffer', owner.optimizer)
            if fresh:  # the buffer starts as the first step
                buf.copy_(step)
            else:
                buf.mul_(momentum).add_(step, alpha=1 - group['dampening'])
            step = step.add(buf, alpha=momentum) if group['nesterov'] else buf
        weight.sub_(step)


class Lamb:
    """MMPretrain's (timm's) Lamb: gradients clipped by their global norm
    (``max_grad_norm``), Adam moments, the update ``m / (sqrt(v) + eps)`` plus weight decay,
    scaled per parameter by ``|w| / |update|`` (1 where either is 0; at most 1 with
    ``trust_clip``; only with weight decay or ``always_adapt``)."""

    @staticmethod
    def _update(group: dict, moments: tuple[torch.Tensor, torch.Tensor],
                weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """One slice's update; ``moments`` (views of its states) move in place."""
        beta1, beta2 = group['betas']
        beta3 = 1 - beta1 if group['grad_averaging'] else 1.0
        step = group['step']
        if group['bias_correction']:
            correction1, correction2 = 1 - beta1 ** step, 1 - beta2 ** step
        else:
            correction1, correction2 = 1.0, 1.0
        avg, avg_sq = moments
        avg.mul_(beta1).add_(grad, alpha=beta3)
        avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (avg_sq.sqrt() / math.sqrt(correction2)).add_(group['eps'])
        update = (avg / correction1).div_(denom)
        if group['weight_decay'] != 0:
            update.add_(weight, alpha=group['weight_decay'])
        return update

    @staticmethod
    def before(owner: PartitionedNormStep, items: list[Call]) -> dict[str, torch.Tensor]:
        """The clip by all gradients' norm (DeepSpeed's, no collective); the step counts."""
        total = owner.global_grad_norm().double()
        max_norm = owner.optimizer.defaults['max_grad_norm']
        for call in items:  # one count per optimizer step
            if call.item.first:
                call.group['step'] = call.group.get('step', 0) + 1
        return {'clip': torch.where(total > max_norm, total / max_norm,
                                    torch.ones_like(total)).float()}

    @staticmethod
    def scaled(group: dict) -> bool:
        return group['weight_decay'] != 0 or bool(group.get('always_adapt', False))

    @staticmethod
    def normed(owner: PartitionedNormStep, call: Call,
               norms: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The weight and the update, from a copy of the moments (the real ones move when
        the slice is stepped)."""
        moments = (call.state('exp_avg', owner.optimizer).clone(),
                   call.state('exp_avg_sq', owner.optimizer).clone())
        return call.weight(), Lamb._update(call.group, moments, call.weight(),
                                            call.grad() / norms['clip'])

    @staticmethod
    def scales(owner: PartitionedNormStep, items: list[Call],
               reduced: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        weight, update_norm = reduced
        ones = torch.ones_like(weight)
        ratio = torch.where(weight > 0,
                            torch.where(update_norm > 0, weight / update_norm, ones), ones)
        trust_clip, decay, always = (setting(owner, items, key, default, weight.device)
                                     for key, default in (('trust_clip', False),
                                                          ('weight_decay', 0.0),
                                                          ('always_adapt', False)))
        ratio = torch.where(trust_clip > 0, ratio.clamp(max=1.0), ratio)
        return {'trust': torch.where((decay != 0) | (always > 0), ratio, ones).float()}

    @staticmethod
    def apply(owner: PartitionedNormStep, call: Call, norms: dict[str, torch.Tensor],
              index: int, fresh: bool) -> None:
        moments = (call.state('exp_avg', owner.optimizer),
                   call.state('exp_avg_sq', owner.optimizer))
        update = Lamb._update(call.group, moments, call.weight(),
                               call.grad().div_(norms['clip']))
        if 'trust' in norms:
            update.mul_(norms['trust'][index])
        call.weight().add_(update, alpha=-call.group['lr'])


MATHS: dict[str, Any] = {'lars': Lars, 'lamb': Lamb}
