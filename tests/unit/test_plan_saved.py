"""plan/saved.py: saved tensors counted while autograd holds them, once per storage."""
from __future__ import annotations

import threading

import torch
from torch import nn

from mmengine_deepspeed.plan.saved import SavedTensorCounter

FLOAT = 4


def _forward(model: nn.Module, counter: SavedTensorCounter) -> torch.Tensor:
    with counter.hooks():
        return torch.relu(model(torch.ones(4, 8))).sum()


def test_a_backward_frees_its_forwards_count() -> None:
    model = nn.Linear(8, 16)
    counter = SavedTensorCounter(model)
    one = 4 * 8 * FLOAT + 4 * 16 * FLOAT  # addmm's input, relu's output; not the weight
    _forward(model, counter).backward()
    assert counter.peak == (one, 0) and counter.now == [0, 0]
    _forward(model, counter).backward()  # one at a time: the peak is one forward's
    assert counter.peak == (one, 0)
    first, second = _forward(model, counter), _forward(model, counter)  # a GAN's two forwards
    assert counter.peak == (2 * one, 0)
    (first + second).backward()
    assert counter.now == [0, 0] and not counter.live


def test_a_storage_saved_twice_counts_once_and_integers_apart() -> None:
    counter = SavedTensorCounter(nn.Linear(1, 1))
    x = torch.ones(16, requires_grad=True)
    index = torch.arange(8)
    with counter.hooks():
        y = x * x  # x saved twice: one storage
        z = y[index]  # the index is saved (an integer tensor); y's gather saves no floats
    assert counter.peak[0] == 16 * FLOAT
    assert counter.peak[1] == 8 * 8
    z.sum().backward()
    assert counter.now == [0, 0]


def test_release_all_stands_in_for_a_backward_that_never_runs() -> None:
    """A stale release (autograd letting go after the stand-in) changes nothing."""
    model = nn.Linear(8, 16)
    counter = SavedTensorCounter(model)
    loss = _forward(model, counter)
    counter.release_all()
    kept = _forward(model, counter)
    del loss  # the first graph goes now, after release_all: its releases are stale
    assert counter.now[0] == 4 * 8 * FLOAT + 4 * 16 * FLOAT
    kept.backward()
    assert counter.now == [0, 0]


def test_releases_from_another_thread() -> None:
    """CUDA's autograd lets go of saved tensors on its own threads."""
    model = nn.Linear(8, 16)
    counter = SavedTensorCounter(model)
    loss = _forward(model, counter)
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    assert counter.now == [0, 0]
