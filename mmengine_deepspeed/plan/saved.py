"""What autograd saves for backward, counted as it is saved and as it is let go.

Used by ``plan`` (a step traced on the meta device) and by the training log
(a run's first iteration, for a model the meta device cannot run). Only
metadata is read (storage sizes), so counting makes no device wait. Imports
nothing of the package but compat: the hooks use it while the engines are built.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import nn

from ..compat import is_zero3_param, storage_key


class _Held:
    """What autograd keeps for one saved tensor while the counter runs: the tensor, and the
    release of its count once autograd lets go of it (after backward, or with the graph)."""

    __slots__ = ('release', 'tensor')

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]):
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


class SavedTensorCounter:
    """The most bytes autograd holds saved for backward at once, counted once per storage.

    Used as ``saved_tensors_hooks`` over a training step: each saved tensor is
    counted while autograd holds it (its storage's size, read from metadata:
    no value is read, no device waits), so several forwards before one
    backward (a GAN) add up and a backward frees its forward's count. On the
    meta device nothing runs backward: :meth:`release_all` stands in for it.
    Parameters (and views of them) are not activations and are not counted.
    A lock guards the counts: CUDA's autograd releases (and a checkpointed
    region packs) on its own threads.

    Args:
        model (nn.Module): The model whose parameters are left out.
    """

    def __init__(self, model: nn.Module):
        # Parameters' storages, held so that no activation's storage can take their address;
        # ZeRO-3's swap theirs at every gather (they are saved as themselves or as views)
        self.kept = [p.detach() for p in model.parameters() if not is_zero3_param(p)]
        self.params = {storage_key(p) for p in self.kept}
        self.live: dict[int, list] = {}  # storage -> [holders, bytes, floating]
        self.generation = 0
        self.now = [0, 0]  # float bytes, other bytes held
        self.peak = (0, 0)
        self.lock = threading.Lock()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that counts what autograd saves inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        if (isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)
                or storage_key(tensor) in self.params):
            return tensor
        key = storage_key(tensor)
        with self.lock:
            entry = self.live.get(key)
            if entry is None:
                entry = self.live[key] = [0, tensor.untyped_storage().nbytes(),
                                          0 if tensor.is_floating_point() else 1]
                self.now[entry[2]] += entry[1]
                if sum(self.now) > sum(self.peak):
                    self.peak = (self.now[0], self.now[1])
            entry[0] += 1
            generation = self.generation
        return _Held(tensor, lambda: self._release(key, generation))

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release_all(self) -> None:
        """Autograd let go of everything counted so far (a backward that did not run)."""
        with self.lock:
            self.live.clear()
            self.now = [0, 0]
            self.generation += 1

    def _release(self, key: int, generation: int) -> None:
        with self.lock:
            entry = self.live.get(key)
            if entry is None or generation != self.generation:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self.live[key]
                self.now[entry[2]] -= entry[1]
