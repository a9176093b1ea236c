"""engine/nonfinite.py: a non-finite loss makes its gradients non-finite, a finite one
leaves them bit for bit (the skip itself is checked with DeepSpeed on 2 ranks in
tests/dist/test_nonfinite.py)."""
from __future__ import annotations

import torch

from mmengine_deepspeed.engine.nonfinite import guard_loss


def _grads(loss_of: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    loss = loss_of(model(torch.randn(8, 4)))  # type: ignore[operator]
    guard_loss(loss).backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def test_a_finite_loss_keeps_its_gradients_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    model(torch.randn(8, 4)).pow(2).mean().backward()
    plain = [p.grad for p in model.parameters()]
    guarded = _grads(lambda out: out.pow(2).mean())
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded))


def test_a_finite_bf16_loss_keeps_its_value_dtype_and_gradients() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    loss = (weight * 3).pow(2).mean()
    guarded = guard_loss(loss)
    assert guarded.dtype == torch.bfloat16 and torch.equal(guarded.detach(), loss.detach())
    (plain,) = torch.autograd.grad(loss, weight, retain_graph=True)
    (through,) = torch.autograd.grad(guarded, weight)
    assert torch.equal(plain, through)


def test_a_non_finite_loss_with_finite_gradients_gets_non_finite_ones() -> None:
    """A NaN or Inf added to the loss (a detached term) leaves the gradients finite: the
    update would be applied on every rank without the guard."""
    for bad in (float('nan'), float('inf')):
        grads = _grads(lambda out, bad=bad: out.pow(2).mean() + bad)
        assert all(not bool(torch.isfinite(g).all()) for g in grads)
