"""A collated batch in equal parts, each as if its samples had been collated alone.

For a batch split into more micro-batches after the loader's workers collated it
(``engine/split_retry.py``). MMEngine's two collates, ``pseudo_collate`` and
``default_collate``, keep a sample's containers (a mapping, a sequence, a named tuple) and
put at each of its leaves the batch's values of that leaf: a list (``pseudo_collate``;
``default_collate`` for data samples and strings) or a tensor stacked along a first
dimension (``default_collate``). So a part of the batch is the same containers with a
slice of each leaf. The containers are read from a sample, never guessed from the batch:
a list of three images and a batch of three samples look alike.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch
from mmengine.dataset import default_collate, pseudo_collate

# what a sample's containers are made of: None at a leaf
Containers = Optional[Union[tuple[str, dict[Any, Any]], tuple[str, list[Any]]]]

COLLATES: tuple[Callable[..., Any], ...] = (pseudo_collate, default_collate)


def containers_of(sample: Any) -> Containers:
    """``sample``'s containers, as both collates walk them (strings are leaves)."""
    if isinstance(sample, (str, bytes)):
        return None
    if isinstance(sample, tuple) and hasattr(sample, '_fields'):
        return ('named', [containers_of(value) for value in sample])
    if isinstance(sample, Sequence):
        return ('sequence', [containers_of(value) for value in sample])
    if isinstance(sample, Mapping):
        return ('mapping', {key: containers_of(value) for key, value in sample.items()})
    return None


def split_collated(batch: Any, containers: Containers, parts: int) -> list[Any]:
    """``batch`` (collated from samples with ``containers``) as ``parts`` collated batches
    of equal, consecutive samples: what collating each part's samples gives (tensors are
    views of the batch's).

    Raises:
        ValueError: A leaf's values do not divide into ``parts``.
    """
    if containers is None:
        size, rest = divmod(len(batch), parts)
        if rest or not size:
            raise ValueError(f'A collated batch of {len(batch)} samples does not split into '
                             f'{parts} equal micro-batches.')
        if isinstance(batch, torch.Tensor):
            return list(batch.split(size))
        return [batch[at * size:(at + 1) * size] for at in range(parts)]
    kind, inner = containers
    if kind == 'mapping':
        assert isinstance(inner, dict)
        by_key = {key: split_collated(batch[key], sub, parts) for key, sub in inner.items()}
        return [type(batch)({key: values[at] for key, values in by_key.items()})
                for at in range(parts)]
    assert isinstance(inner, list)
    fields = [split_collated(value, sub, parts) for value, sub in zip(batch, inner)]
    if kind == 'named':
        return [type(batch)(*(field[at] for field in fields)) for at in range(parts)]
    return [_like(batch, [field[at] for field in fields]) for at in range(parts)]


def _like(batch: Any, values: list[Any]) -> Any:
    """``values`` in ``batch``'s sequence type, as the collates build it (a list where the
    type cannot be built from a list)."""
    try:
        return type(batch)(values)
    except TypeError:
        return values
