"""A GAN written after MMEngine's "Train a GAN" tutorial, on synthetic images.

What the tutorial's model does and DeepSpeed integrations give up on: its own
``train_step`` takes ``optim_wrapper['discriminator']`` and
``optim_wrapper['generator']``, enters ``optim_context(submodule)``, calls the
submodules directly, and switches the discriminator's ``requires_grad`` off
around the generator step. The generator has BatchNorm; ``generator_ema`` is
in no optimizer (it stays plain). The noise comes with each sample, or, as in
the tutorial, from ``torch.randn`` in ``train_step`` (``noise_from='randn'``): then
runs with and without DeepSpeed see the same noise only if they draw from the global
stream at the same points.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseDataPreprocessor, BaseModel
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.registry import DATASETS, METRICS, MODELS
from torch import nn
from torch.utils.data import Dataset

IMAGE = 16   # a 4x4 single-channel "image", flattened
NOISE = 8


@DATASETS.register_module()
class ToyImageDataset(Dataset):
    """Images from a fixed low-rank distribution, each with its own noise vector."""

    def __init__(self, size: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        basis = torch.randn(3, IMAGE, generator=gen)
        self.images = torch.tanh(torch.randn(size, 3, generator=gen) @ basis)
        self.noise = torch.randn(size, NOISE, generator=gen)
        self.metainfo: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return dict(inputs=self.images[index], noise=self.noise[index])


@MODELS.register_module()
class ToyGANPreprocessor(BaseDataPreprocessor):
    """Moves the batch to the model's device."""

    def forward(self, data: dict, training: bool = False) -> dict:
        return self.cast_data(data)


def set_requires_grad(module: nn.Module, flag: bool) -> None:
    """As in the tutorial: freeze the discriminator for the generator step."""
    for param in module.parameters():
        param.requires_grad = flag


@MODELS.register_module()
class ToyGAN(BaseModel):
    """Generator (with BatchNorm) and discriminator, trained by the model's own step."""

    def __init__(self, data_preprocessor: Optional[dict] = None, noise_from: str = 'sample'):
        super().__init__(data_preprocessor=data_preprocessor or dict(type='ToyGANPreprocessor'))
        self.noise_from = noise_from
        # No bias before BatchNorm (it would have no gradient, as in real GANs).
        self.generator = nn.Sequential(nn.Linear(NOISE, 32, bias=False), nn.BatchNorm1d(32),
                                       nn.ReLU(), nn.Linear(32, IMAGE), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(IMAGE, 32), nn.LeakyReLU(0.2),
                                           nn.Linear(32, 1))
        self.generator_ema = copy.deepcopy(self.generator)
        set_requires_grad(self.generator_ema, False)
        self.val_modes: list[bool] = []  # training flags of all submodules seen by val_step

    def init_weights(self) -> None:
        """Deterministic init, so every run starts from the same weights."""
        gen = torch.Generator().manual_seed(4321)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.2)
                    if module.bias is not None:
                        module.bias.zero_()
        self.generator_ema.load_state_dict(self.generator.state_dict())

    def forward(self, inputs: torch.Tensor, noise: torch.Tensor, mode: str = 'tensor') -> Any:
        images = self.generator(noise)
        if mode == 'predict':
            scores = self.discriminator(images).squeeze(1)
            return [dict(score=s) for s in scores]
        return images

    def train_step(self, data: dict, optim_wrapper: OptimWrapperDict) -> dict[str, torch.Tensor]:
        batch = self.data_preprocessor(data, True)
        real, noise = batch['inputs'], batch['noise']
        if self.noise_from == 'randn':  # the tutorial's latent
            noise = torch.randn(real.shape[0], NOISE, device=real.device)

        disc_optim = optim_wrapper['discriminator']
        with disc_optim.optim_context(self.discriminator):
            fake = self.generator(noise).detach()
            loss_d = F.softplus(self.discriminator(fake)).mean() + \
                F.softplus(-self.discriminator(real)).mean()
        disc_optim.update_params(loss_d)

        set_requires_grad(self.discriminator, False)
        gen_optim = optim_wrapper['generator']
        with gen_optim.optim_context(self.generator):
            loss_g = F.softplus(-self.discriminator(self.generator(noise))).mean()
        gen_optim.update_params(loss_g)
        set_requires_grad(self.discriminator, True)
        return dict(loss=(loss_d + loss_g).detach().float(), loss_d=loss_d.detach().float(),
                    loss_g=loss_g.detach().float())

    def val_step(self, data: dict) -> list:
        self.val_modes += [m.training for m in self.modules()]
        batch = self.data_preprocessor(data, False)
        return self(**batch, mode='predict')

    def test_step(self, data: dict) -> list:
        return self.val_step(data)


@METRICS.register_module()
class ToyScoreMetric(BaseMetric):
    """Mean discriminator score of generated samples."""

    def process(self, data_batch: Any, data_samples: Sequence[dict]) -> None:
        self.results += [float(sample['score']) for sample in data_samples]

    def compute_metrics(self, results: list) -> dict[str, float]:
        return dict(score=sum(results) / max(len(results), 1))


ADAM = dict(type='Adam', lr=2e-3, betas=(0.5, 0.999))


def gan_wrappers(model: ToyGAN) -> OptimWrapperDict:
    """The tutorial's form: optim wrappers built by the user on each submodule."""
    return OptimWrapperDict(
        generator=OptimWrapper(torch.optim.Adam(model.generator.parameters(), lr=2e-3,
                                                betas=(0.5, 0.999)), accumulative_counts=2),
        discriminator=OptimWrapper(torch.optim.Adam(model.discriminator.parameters(), lr=2e-3,
                                                    betas=(0.5, 0.999)),
                                   clip_grad=dict(max_norm=1.0)))


def gan_config(work_dir: str, *, ds_config: Optional[dict] = None, max_iters: int = 30,
               batch_size: int = 4, checkpoint: Optional[dict] = None, val: bool = True,
               **extra: Any) -> dict:
    """A runner config (``cfg`` style) for the toy GAN, in the config form.

    The generator accumulates over 2 iterations, the discriminator clips at
    1.0, and each has its own schedule, so every per-optimizer setting is used.
    """
    cfg: dict = dict(
        model=dict(type='ToyGAN'),
        work_dir=work_dir,
        train_dataloader=dict(
            batch_size=batch_size, num_workers=0, dataset=dict(type='ToyImageDataset', size=32),
            sampler=dict(type='DefaultSampler', shuffle=True, seed=7),
            collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=max_iters),
        optim_wrapper=dict(
            constructor='SubmoduleOptimWrapperConstructor',
            generator=dict(optimizer=ADAM, accumulative_counts=2),
            discriminator=dict(optimizer=ADAM, clip_grad=dict(max_norm=1.0))),
        param_scheduler=dict(
            generator=[dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0, end=6)],
            discriminator=[dict(type='MultiStepLR', milestones=[5], gamma=0.5,
                                by_epoch=False)]),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1), checkpoint=checkpoint),
        randomness=dict(seed=3),
        log_level='WARNING',
        env_cfg=dict(dist_cfg=dict(backend='gloo', timeout=60)),
    )
    if val:
        cfg.update(val_dataloader=dict(
            batch_size=4, num_workers=0, dataset=dict(type='ToyImageDataset', size=8, seed=1),
            sampler=dict(type='DefaultSampler', shuffle=False),
            collate_fn=dict(type='default_collate')),
            val_cfg=dict(), val_evaluator=dict(type='ToyScoreMetric'))
    if ds_config is not None:
        cfg['ds_config'] = ds_config
    cfg.update(extra)
    return cfg
