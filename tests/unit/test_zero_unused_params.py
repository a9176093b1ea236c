"""zero/unused_params.py: parameters some ranks skip."""
from __future__ import annotations

import torch
from torch import nn


def test_find_unused_parameters_gradients_arrive_in_one_order_whatever_was_used() -> None:
    """DeepSpeed reduces gradients in the order they arrive: the surrogate makes that order
    depend on the parameter list only, gives skipped parameters zeros and carries the scale
    DeepSpeed puts on the loss (the fp16 loss scale) exactly."""
    from mmengine_deepspeed.zero.unused_params import reached_parameters, with_every_parameter

    def run(use_head: bool) -> tuple[list[int], list[torch.Tensor]]:
        torch.manual_seed(0)
        body, head = nn.Linear(3, 3), nn.Linear(3, 3)
        params = [*body.parameters(), *head.parameters()]
        order: list[int] = []
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(lambda p, i=index: order.append(i))
        out = body(torch.ones(2, 3))
        loss = (head(out) if use_head else out).sum()
        assert (id(params[2]) in reached_parameters(loss)) is use_head
        (with_every_parameter(loss, params, retain_graph=False) * 1024.0).backward()
        return order, [p.grad.clone() for p in params]

    used_order, _ = run(True)
    skipped_order, skipped_grads = run(False)
    assert used_order == skipped_order
    assert not skipped_grads[2].any() and not skipped_grads[3].any()
    torch.manual_seed(0)
    body = nn.Linear(3, 3)
    (body(torch.ones(2, 3)).sum() * 1024.0).backward()
    assert torch.equal(skipped_grads[0], body.weight.grad)
