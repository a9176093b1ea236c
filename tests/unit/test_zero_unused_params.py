"""zero/unused_params.py: parameters some ranks skip."""
from __future__ import annotations

import pytest
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


def test_the_graph_is_walked_again_only_when_its_size_changes_or_periodically(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady iterations cost no walk; a skipped head changes the graph's size and is caught
    at once; routing between two heads of one size is caught at the next periodic walk.
    (One process: the ranks' first agreement is this rank's own set.)"""
    from mmengine_deepspeed.zero import unused_params

    walks: list[int] = []
    walk = unused_params.reached_parameters
    monkeypatch.setattr(unused_params, 'reached_parameters',
                        lambda loss: walks.append(len(walks)) or walk(loss))
    monkeypatch.setattr(unused_params.UsedParameters, '_agree',
                        staticmethod(lambda names, used: used))
    body, head, other = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    named = [(f'{prefix}.{name}', p) for prefix, module in
             (('body', body), ('head', head), ('other', other))
             for name, p in module.named_parameters()]
    check = unused_params.UsedParameters()

    def backward(route: str) -> None:
        out = body(torch.ones(2, 3))
        branch = {'head': head, 'other': other}.get(route)
        loss = (out if branch is None else branch(out)).sum()
        check.check(loss, [name for name, _ in named], [p for _, p in named])

    period = unused_params.FULL_CHECK_PERIOD
    for _ in range(period + 5):
        backward('head')
    assert len(walks) == unused_params.FIRST_FULL_CHECKS + 1  # and the periodic one
    with pytest.raises(RuntimeError, match=r'now unused: head\.weight, head\.bias'):
        backward('none')
    walks.clear()
    check = unused_params.UsedParameters()
    for _ in range(period - 2):
        backward('head')
    backward('other')  # the same size: not seen until the period's walk, the next one
    with pytest.raises(RuntimeError, match=r'now used: other\.weight, other\.bias'):
        for _ in range(period):
            backward('other')
    assert len(walks) == unused_params.FIRST_FULL_CHECKS + 1
    # A new set of trainable parameters (a GAN's other step, an unfrozen backbone) is agreed on
    # at the next walk every rank takes, not at a walk one rank's graph alone triggered.
    agreements: list[frozenset[str]] = []
    monkeypatch.setattr(unused_params.UsedParameters, '_agree',
                        staticmethod(lambda names, used: agreements.append(used) or used))
    check = unused_params.UsedParameters()
    for _ in range(period - 2):
        backward('head')
    head.requires_grad_(False)
    backward('none')  # another size: this rank walks, but does not agree alone
    assert len(agreements) == 1
    backward('none')  # the 50th: every rank walks and agrees
    assert agreements[1] == {'body.weight', 'body.bias'}


def test_the_walk_reaches_exactly_the_parameters_that_get_gradients() -> None:
    """reached_parameters against autograd itself: tied weights (one leaf, two uses), a
    shared subexpression (a node reached twice), a frozen and an unused parameter, a branch
    that this input skips, a leaf that is not a parameter."""
    from mmengine_deepspeed.zero.unused_params import reached_parameters

    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    frozen = nn.Linear(4, 4).requires_grad_(False)
    unused = nn.Linear(4, 4)
    skipped = nn.Linear(4, 4)
    scale = torch.ones(4, requires_grad=True)  # a leaf, not a parameter
    x = emb(torch.tensor([1, 2, 3]))
    shared = frozen(x) * scale
    out = head(shared + shared.tanh())  # `shared` reached along two paths
    if out.sum() > 1e9:  # never: this input skips the branch
        out = out + skipped(x).sum()
    loss = out.pow(2).mean()
    leaves = [emb.weight, frozen.weight, unused.weight, skipped.weight, scale]
    grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad],
                                retain_graph=True, allow_unused=True)
    expected = {id(t) for t, g in zip([t for t in leaves if t.requires_grad], grads)
                if g is not None}
    assert reached_parameters(loss) == expected == {id(emb.weight), id(scale)}
    assert reached_parameters(loss.detach()) == set()
