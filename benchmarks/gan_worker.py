"""One rank of the GAN benchmark: train N iterations one way, report the speed.

Usage (under torchrun): ``gan_worker.py MODE STAGE WARMUP ITERS WORK_DIR [--profile]``, MODE
``raw`` (two engines from ``deepspeed.initialize`` and a hand-written loop, the
generator and discriminator called through their engines) or ``runner``
(DeepSpeedRunner with ``optim_wrapper`` per submodule; the model's own
``train_step`` does the same two steps). fp32, Adam, one rank per process on
gloo (NCCL on CUDA). Rank 0 prints ``RESULT {json}``; with ``--profile`` its measured
iterations run under cProfile and the result carries each package's own time.
"""
from __future__ import annotations

import time

PROCESS_START = time.time()

import json  # noqa: E402
import sys  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.registry import DATASETS, MODELS  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from benchmarks.overhead_worker import BACKEND, Clock, Recorder  # noqa: E402

NOISE, WIDTH, IMAGE, BATCH = 128, 1024, 3072, 32  # 32x32 RGB images
ADAM = dict(lr=2e-4, betas=(0.5, 0.999))


@DATASETS.register_module()
class RandomImages(Dataset):
    """Random images in [-1, 1] with their noise vectors."""

    def __init__(self, size: int = 8192):
        gen = torch.Generator().manual_seed(0)
        self.images = torch.rand(size, IMAGE, generator=gen) * 2 - 1
        self.noise = torch.randn(size, NOISE, generator=gen)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return dict(inputs=self.images[index], noise=self.noise[index])


def discriminator_loss(disc: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    return F.softplus(disc(fake)).mean() + F.softplus(-disc(real)).mean()


def generator_loss(disc: nn.Module, fake: torch.Tensor) -> torch.Tensor:
    return F.softplus(-disc(fake)).mean()


def freeze(module: nn.Module, frozen: bool) -> None:
    for param in module.parameters():
        param.requires_grad = not frozen


@MODELS.register_module()
class BenchGAN(BaseModel):
    """An MLP GAN (~4.3M generator and ~3.1M discriminator parameters)."""

    def __init__(self, data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.generator = nn.Sequential(
            nn.Linear(NOISE, WIDTH, bias=False), nn.BatchNorm1d(WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, IMAGE), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(IMAGE, WIDTH), nn.LeakyReLU(0.2),
                                           nn.Linear(WIDTH, 1))

    def forward(self, inputs: torch.Tensor, noise: torch.Tensor, mode: str = 'tensor') -> Any:
        return self.generator(noise)

    def train_step(self, data: dict, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        batch = self.data_preprocessor(data, True)
        with optim_wrapper['discriminator'].optim_context(self.discriminator):
            fake = self.generator(batch['noise']).detach()
            loss_d = discriminator_loss(self.discriminator, batch['inputs'], fake)
        optim_wrapper['discriminator'].update_params(loss_d)
        freeze(self.discriminator, True)
        with optim_wrapper['generator'].optim_context(self.generator):
            loss_g = generator_loss(self.discriminator, self.generator(batch['noise']))
        optim_wrapper['generator'].update_params(loss_g)
        freeze(self.discriminator, False)
        return dict(loss_d=loss_d.detach(), loss_g=loss_g.detach())


def loader_cfg() -> dict:
    return dict(batch_size=BATCH, num_workers=0, dataset=dict(type='RandomImages'),
                sampler=dict(type='DefaultSampler', shuffle=True, seed=0),
                collate_fn=dict(type='default_collate'))


def run_raw(stage: int, iters: int, recorder: Recorder) -> None:
    import deepspeed
    from torch.utils.data import DataLoader, DistributedSampler

    from mmengine_deepspeed.dist import init_distributed
    init_distributed('pytorch', dict(backend=BACKEND))
    torch.manual_seed(0)
    model = BenchGAN()
    dataset = RandomImages()
    loader = DataLoader(dataset, batch_size=BATCH,
                        sampler=DistributedSampler(dataset, shuffle=True, seed=0))
    config = dict(zero_optimization=dict(stage=stage), train_micro_batch_size_per_gpu=BATCH,
                  gradient_accumulation_steps=1, steps_per_print=None)
    gen, *_ = deepspeed.initialize(model=model.generator, config=dict(config),
                                   optimizer=torch.optim.Adam(model.generator.parameters(),
                                                              **ADAM))
    disc, *_ = deepspeed.initialize(model=model.discriminator, config=dict(config),
                                    optimizer=torch.optim.Adam(model.discriminator.parameters(),
                                                               **ADAM))
    batches = iter(loader)
    for _ in range(iters):
        batch = next(batches)
        real, noise = batch['inputs'].to(gen.device), batch['noise'].to(gen.device)
        loss_d = discriminator_loss(disc, real, gen(noise).detach())
        disc.backward(loss_d)
        disc.step()
        freeze(model.discriminator, True)
        loss_g = generator_loss(disc, gen(noise))
        gen.backward(loss_g)
        gen.step()
        freeze(model.discriminator, False)
        recorder.record()


def run_runner(stage: int, iters: int, work_dir: str, recorder: Recorder) -> None:
    from mmengine_deepspeed import DeepSpeedRunner

    adam = dict(type='Adam', **ADAM)
    runner = DeepSpeedRunner(
        model=dict(type='BenchGAN'), work_dir=work_dir, train_dataloader=loader_cfg(),
        train_cfg=dict(by_epoch=False, max_iters=iters),
        optim_wrapper=dict(constructor='SubmoduleOptimWrapperConstructor',
                           generator=dict(optimizer=adam), discriminator=dict(optimizer=adam)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=10**6), checkpoint=None),
        log_level='WARNING', randomness=dict(seed=0), launcher='pytorch',
        env_cfg=dict(dist_cfg=dict(backend=BACKEND)),
        ds_config=dict(zero_optimization=dict(stage=stage)))
    runner.register_hook(Clock(recorder))
    runner.train()


def main() -> None:
    mode, stage, warmup, iters = sys.argv[1], *map(int, sys.argv[2:5])
    recorder = Recorder(warmup, iters, profile='--profile' in sys.argv[6:])
    if mode == 'raw':
        run_raw(stage, warmup + iters, recorder)
    else:
        run_runner(stage, warmup + iters, sys.argv[5], recorder)
    wall = [stamp[0] for stamp in recorder.stamps[warmup:]]
    if dist.get_rank() == 0:
        print('RESULT ' + json.dumps(dict(
            mode=mode, stage=stage, it_per_s=(len(wall) - 1) / (wall[-1] - wall[0]),
            first_iter_s=recorder.stamps[0][0] - PROCESS_START, world=dist.get_world_size(),
            profile_ms=recorder.profile_ms())),
            flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
