"""A tiny GPT (pre-norm decoder blocks) as an MMEngine BaseModel, and its metric."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import METRICS, MODELS
from torch import nn
from typing_extensions import override


class Block(nn.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm and a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


@MODELS.register_module()
class TinyGPT(BaseModel):
    """Byte-level GPT.

    Args:
        block_size (int): Context length. Defaults to 64.
        width (int): Model width. Defaults to 128.
        depth (int): Number of blocks. Defaults to 4.
        heads (int): Attention heads. Defaults to 4.
        vocab_size (int): Defaults to 256 (bytes).
    """

    def __init__(self, block_size: int = 64, width: int = 128, depth: int = 4, heads: int = 4,
                 vocab_size: int = 256, data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.block_size = block_size
        self.tokens_per_sample = block_size  # read by the throughput log
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.zeros(1, block_size, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    @override
    def init_weights(self) -> None:
        """GPT-2 style: normal(0, 0.02) weights, zero biases."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.position, std=0.02)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Next-byte logits for every position of ``inputs`` ([B, T] byte ids)."""
        x = self.embed(inputs) + self.position[:, :inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @override
    def forward(  # type: ignore[override]  # MMEngine calls forward(**batch): its own keys
            self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None,
            mode: str = 'tensor') -> Any:
        logits = self.logits(inputs)
        if mode == 'tensor':
            return logits
        if targets is None:
            raise ValueError(f"mode={mode!r} needs targets (the next bytes).")
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               reduction='none').view(targets.shape).mean(dim=1)
        if mode == 'loss':
            return dict(loss=loss.mean())
        return [dict(loss=value) for value in loss.detach().float().cpu()]

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int, temperature: float = 0.8,
                 seed: int = 0) -> bytes:
        """Sample ``length`` bytes after ``prompt`` (on CPU, for the demo's sample)."""
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.tensor([list(prompt)], dtype=torch.long)
        for _ in range(length):
            logits = self.logits(tokens[:, -self.block_size:])[0, -1].float() / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        return bytes(tokens[0, len(prompt):].tolist())


@METRICS.register_module()
class ValLoss(BaseMetric):
    """Mean next-byte cross-entropy over the validation set (nats per byte), as ``val/nll``.

    Not named ``loss``: MMEngine's LogProcessor averages every key matching its
    ``mean_pattern`` (``loss``, ``time``...) over its window, for validation metrics too,
    so its log line and ``scalars.json`` would show the mean of the last validations
    instead of this one's value.
    """

    default_prefix = 'val'

    @override
    def process(self, data_batch: Any, data_samples: Sequence[dict]) -> None:
        self.results.extend(float(s['loss']) for s in data_samples)

    @override
    def compute_metrics(self, results: list) -> dict[str, float]:
        return dict(nll=sum(results) / max(len(results), 1))
