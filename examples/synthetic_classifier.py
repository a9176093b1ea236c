"""A small image classifier on synthetic data, for the example config.

The images are class-dependent colour blobs plus noise, generated from a fixed
seed, so the example needs no download and visibly learns in a few hundred
iterations on a CPU.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, METRICS, MODELS
from torch import nn
from torch.utils.data import Dataset


@DATASETS.register_module()
class SyntheticImages(Dataset):
    """``size`` 3x32x32 images in ``num_classes`` classes, reproducible from ``seed``."""

    def __init__(self, size: int = 512, num_classes: int = 10, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        prototypes = torch.rand(num_classes, 3, 8, 8, generator=torch.Generator().manual_seed(7))
        self.labels = torch.randint(num_classes, (size,), generator=gen)
        blobs = F.interpolate(prototypes[self.labels], size=32, mode='bilinear')
        self.images = blobs + 0.3 * torch.randn(size, 3, 32, 32, generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return dict(inputs=self.images[index], labels=self.labels[index])


@MODELS.register_module()
class SmallConvNet(BaseModel):
    """Conv-BN-ReLU x3 and a linear head: BatchNorm buffers, like real backbones."""

    def __init__(self, num_classes: int = 10, width: int = 32,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        layers: list[nn.Module] = []
        channels = 3
        for out in (width, width * 2, width * 4):
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            channels = out
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = self.head(self.backbone(inputs).mean(dim=(2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits.float(), labels))
        if mode == 'predict':
            return [dict(pred=p, label=t) for p, t in zip(logits.argmax(1), labels)]
        return logits


@METRICS.register_module()
class SyntheticAccuracy(BaseMetric):
    """Top-1 accuracy in percent."""

    default_prefix = 'val'

    def process(self, data_batch: Any, data_samples: list) -> None:
        self.results.extend(float(s['pred'] == s['label']) for s in data_samples)

    def compute_metrics(self, results: list) -> dict[str, float]:
        return dict(accuracy=100.0 * sum(results) / max(len(results), 1))
