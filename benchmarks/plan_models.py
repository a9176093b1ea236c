"""The model families ``plan_accuracy.py`` plans and trains, and their MMEngine configs.

Three families, two sizes each (the larger over 50M parameters): the demo GPT
(``TinyGPT``), a CNN with BatchNorm (``examples.synthetic_classifier.SmallConvNet``),
and a transformer encoder whose embedding and first half of layers are frozen
(``FrozenEncoder``, below; torch's own encoder layers, with dropout). The CPU
heap coefficients of ``mmengine_deepspeed/plan/memory.py`` were fitted to these
(:data:`FITTED`); :data:`HELD_OUT` are shapes that took no part in the fit (wider,
deeper, layers over glibc's 32 MiB mmap threshold, a mid-sized CNN), to report the
planner's error out of sample.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.registry import MODELS
from torch import nn
from typing_extensions import override


@MODELS.register_module()
class FrozenEncoder(BaseModel):
    """Byte embedding (frozen), ``depth`` encoder layers (the first half frozen), byte head.

    Args:
        width (int): Model width.
        depth (int): Encoder layers.
        heads (int): Attention heads.
        block_size (int): Sequence length.
    """

    def __init__(self, width: int = 128, depth: int = 4, heads: int = 4, block_size: int = 64,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(1, block_size, width))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True)
            for _ in range(depth))
        self.head = nn.Linear(width, 256)
        for module in [self.embed, *self.layers[:depth // 2]]:
            module.requires_grad_(False)
        self.position.requires_grad_(False)

    @override
    def forward(  # type: ignore[override]  # MMEngine calls forward(**batch)
            self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None,
            mode: str = 'tensor') -> Any:
        x = self.embed(inputs) + self.position[:, :inputs.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        if mode == 'tensor' or targets is None:
            return logits
        return dict(loss=F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()))


def _loader(batch_size: int, dataset: dict) -> dict:
    return dict(batch_size=batch_size, num_workers=0, dataset=dataset,
                sampler=dict(type='InfiniteSampler', shuffle=True),
                collate_fn=dict(type='default_collate'))


def _text_loader(batch_size: int, block_size: int) -> dict:
    return _loader(batch_size, dict(type='StdlibText', part='train', block_size=block_size,
                                    stride=37))


def _image_loader(batch_size: int) -> dict:
    return _loader(batch_size, dict(type='SyntheticImages'))


# family -> size -> (model, train_dataloader)
FAMILIES: dict[str, dict[str, tuple[dict, dict]]] = {
    'gpt': {
        'small': (dict(type='TinyGPT', block_size=64, width=128, depth=4, heads=4),
                  _text_loader(16, 64)),
        'large': (dict(type='TinyGPT', block_size=64, width=512, depth=16, heads=8),
                  _text_loader(8, 64)),
        '1024x12': (dict(type='TinyGPT', block_size=64, width=1024, depth=12, heads=16),
                    _text_loader(8, 64)),
        '2048x4': (dict(type='TinyGPT', block_size=64, width=2048, depth=4, heads=16),
                   _text_loader(4, 64)),
        '768x10': (dict(type='TinyGPT', block_size=128, width=768, depth=10, heads=12),
                   _text_loader(6, 128)),
    },
    'cnn': {
        'small': (dict(type='SmallConvNet', width=32), _image_loader(16)),
        'large': (dict(type='SmallConvNet', width=768), _image_loader(16)),
        '256': (dict(type='SmallConvNet', width=256), _image_loader(32)),
        '128': (dict(type='SmallConvNet', width=128), _image_loader(64)),
    },
    'frozen': {
        'small': (dict(type='FrozenEncoder', width=128, depth=4, heads=4, block_size=64),
                  _text_loader(16, 64)),
        'large': (dict(type='FrozenEncoder', width=768, depth=8, heads=12, block_size=64),
                  _text_loader(8, 64)),
        '384x24': (dict(type='FrozenEncoder', width=384, depth=24, heads=6, block_size=64),
                   _text_loader(16, 64)),
        '1024x4': (dict(type='FrozenEncoder', width=1024, depth=4, heads=16, block_size=64),
                   _text_loader(12, 64)),
    },
}


# (family, size): what the CPU heap's coefficients are fitted to, and what they never saw
FITTED = [*((family, size) for size in ('small', 'large') for family in ('gpt', 'cnn', 'frozen')),
          ('gpt', '1024x12'), ('gpt', '2048x4'), ('frozen', '384x24'), ('cnn', '256')]
HELD_OUT = [('gpt', '768x10'), ('frozen', '1024x4'), ('cnn', '128')]


def config_text(family: str, size: str, stage: int, precision: str, iters: int = 10) -> str:
    """An MMEngine config file's text for one case (what `plan` reads and training runs)."""
    model, loader = FAMILIES[family][size]
    model = dict(model, data_preprocessor=dict(type='BaseDataPreprocessor'))
    ds_config = dict(zero_optimization=dict(stage=stage),
                     bf16=dict(enabled=precision == 'bf16'))
    return '\n'.join([
        "custom_imports = dict(imports=['mmengine_deepspeed', 'mmengine_deepspeed.demo', "
        "'examples.synthetic_classifier', 'benchmarks.plan_models'], "
        'allow_failed_imports=False)',
        "runner_type = 'DeepSpeedRunner'",
        f'ds_config = {ds_config!r}',
        f'model = {model!r}',
        f'train_dataloader = {loader!r}',
        f'train_cfg = dict(by_epoch=False, max_iters={iters})',
        "optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-4))",
        "default_hooks = dict(logger=dict(type='LoggerHook', interval=1), checkpoint=None)",
        'log_processor = dict(by_epoch=False)',
        "log_level = 'WARNING'",
        'randomness = dict(seed=0)',
    ]) + '\n'
