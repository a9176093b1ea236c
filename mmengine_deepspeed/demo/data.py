"""Text that every Python installation ships: its standard library's source.

Bytes are the tokens (vocabulary 256), so nothing needs a tokenizer or a
download. The first 90 % of the text trains, the rest validates.
"""
from __future__ import annotations

import functools
import glob
import math
import os.path as osp
import sysconfig
from collections import Counter

import torch
from mmengine.registry import DATASETS
from torch.utils.data import Dataset
from typing_extensions import override

DEFAULT_BYTES = 1_000_000
VAL_FRACTION = 0.1


@functools.lru_cache(maxsize=4)
def stdlib_text(max_bytes: int = DEFAULT_BYTES) -> bytes:
    """The first ``max_bytes`` of the stdlib's top-level ``.py`` files, in name order."""
    root = sysconfig.get_paths()['stdlib']
    chunks, total = [], 0
    for path in sorted(glob.glob(osp.join(root, '*.py'))):
        with open(path, 'rb') as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(f'no .py files under {root}: the demo needs the stdlib source.')
    return b''.join(chunks)[:max_bytes]


def split(text: bytes, part: str) -> bytes:
    """The ``'train'`` (first 90 %) or ``'val'`` part of ``text``."""
    cut = int(len(text) * (1 - VAL_FRACTION))
    return text[:cut] if part == 'train' else text[cut:]


def unigram_baseline(max_bytes: int = DEFAULT_BYTES) -> float:
    """Validation cross-entropy (nats/byte) of byte frequencies counted on the train part.

    A model that learned nothing beyond "which bytes are common" scores this.
    """
    text = stdlib_text(max_bytes)
    counts = Counter(split(text, 'train'))
    total = sum(counts.values())
    val = split(text, 'val')
    # add-one smoothing so an unseen byte has a finite cost
    return -sum(math.log((counts[b] + 1) / (total + 256)) for b in val) / len(val)


@DATASETS.register_module()
class StdlibText(Dataset):
    """Windows of ``block_size + 1`` bytes; inputs are the first ``block_size``.

    Args:
        part (str): ``'train'`` or ``'val'``.
        block_size (int): Context length. Defaults to 64.
        stride (int): Offset between windows. Defaults to 64.
        max_bytes (int): How much stdlib text to use. Defaults to 1 MB.
    """

    def __init__(self, part: str = 'train', block_size: int = 64, stride: int = 64,
                 max_bytes: int = DEFAULT_BYTES):
        if part not in ('train', 'val'):
            raise ValueError(f"part={part!r}: use 'train' or 'val'.")
        data = split(stdlib_text(max_bytes), part)
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size = block_size
        self.stride = stride
        self.metainfo = dict(vocab_size=256, part=part)

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    @override
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.stride
        window = self.tokens[start:start + self.block_size + 1]
        return dict(inputs=window[:-1], targets=window[1:])
