"""engine/collated.py: a batch collated by MMEngine's collates, split again in equal parts,
is what collating each part's samples gives."""
from __future__ import annotations

from collections import namedtuple
from typing import Any, Callable

import pytest
import torch
from mmengine.dataset import default_collate, pseudo_collate
from mmengine.structures import BaseDataElement

from mmengine_deepspeed.engine.collated import containers_of, split_collated

Pair = namedtuple('Pair', ['image', 'label'])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, BaseDataElement):
        return a is b
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _samples(kind: str, count: int) -> list[Any]:
    """Samples whose collated batch looks like something else: three 3-channel images
    (a list of 3 whose items have 3 rows), pairs of 2 fields in batches of 2."""
    torch.manual_seed(0)
    if kind == 'mmengine':
        return [{'inputs': torch.rand(3, 4, 4),
                 'data_samples': BaseDataElement(metainfo={'index': i})} for i in range(count)]
    if kind == 'tuple':
        return [(torch.rand(2, 2), i) for i in range(count)]
    if kind == 'named':
        return [Pair(torch.rand(3), float(i)) for i in range(count)]
    return [{'meta': {'name': f's{i}', 'size': [i, i + 1]}, 'x': torch.rand(2)}
            for i in range(count)]


@pytest.mark.parametrize('collate', [pseudo_collate, default_collate])
@pytest.mark.parametrize('kind', ['mmengine', 'tuple', 'named', 'nested'])
@pytest.mark.parametrize('count,parts', [(2, 2), (3, 3), (6, 2), (6, 3)])
def test_a_split_batch_is_its_parts_collated(collate: Callable, kind: str, count: int,
                                             parts: int) -> None:
    samples = _samples(kind, count)
    size = count // parts
    got = split_collated(collate(samples), containers_of(samples[0]), parts)
    want = [collate(samples[at * size:(at + 1) * size]) for at in range(parts)]
    assert len(got) == parts and all(map(_same, got, want)), (got, want)


def test_a_batch_that_does_not_divide_is_refused() -> None:
    samples = _samples('mmengine', 3)
    with pytest.raises(ValueError, match='3 samples does not split into 2'):
        split_collated(pseudo_collate(samples), containers_of(samples[0]), 2)
