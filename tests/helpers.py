"""Shared test helpers: a torchrun launcher and toy MMEngine components.

The toy model has what real OpenMMLab models have and integrations get wrong:
BatchNorm buffers, a frozen parameter, a custom data preprocessor, a loss dict
parsed by ``BaseModel.parse_losses`` and a ``predict`` mode scored by a metric.
Importing this module registers the components, so configs can name them.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.model import BaseDataPreprocessor, BaseModel
from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS
from torch import nn
from torch.utils.data import Dataset

from mmengine_deepspeed.compat import dynamo_counts
from mmengine_deepspeed.dist import free_port
from mmengine_deepspeed.engine.wrapper import DeepSpeedEngineWrapper
from mmengine_deepspeed.strategy import RunStrategy

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_FEATURES = 8
NUM_CLASSES = 4


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: repo importable, one thread per rank."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([REPO_ROOT, env.get('PYTHONPATH', '')])
    env['OMP_NUM_THREADS'] = '1'
    env.pop('RANK', None)
    env.pop('WORLD_SIZE', None)
    return env


def run_torchrun(args: Sequence[str], nproc: int = 2, timeout: float = 240,
                 extra_env: Optional[dict[str, str]] = None,
                 torchrun_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run`` on a unique port, killed on timeout.

    torchrun tears the whole group down when one rank fails; the timeout
    covers a hang, killing the process group so no rank outlives the test.

    Args:
        args (Sequence[str]): The script and its arguments.
        nproc (int): Processes per node. Defaults to 2.
        timeout (float): Seconds before everything is killed. Defaults to 240.
        extra_env (dict, optional): Added to the environment. Defaults to None.
        torchrun_args (Sequence[str]): Extra torchrun options. Defaults to ().

    Returns:
        subprocess.CompletedProcess: With ``stdout`` (stderr merged) as text.
    """
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}',
           '--master_addr=127.0.0.1', f'--master_port={free_port()}', *torchrun_args, *args]
    return run_command(cmd, timeout=timeout, extra_env=extra_env)


def launch_scenarios(worker: str, out: str, scenarios: Sequence[dict], nproc: int) -> str:
    """Run a scenario worker (``tests/dist/*worker.py``) under torchrun; fail on a bad exit.

    Args:
        worker (str): The worker script, relative to the repository.
        out (str): Its output directory; ``{out}`` in a scenario becomes it.
        scenarios (Sequence[dict]): One JSON argument each.
        nproc (int): Processes.

    Returns:
        str: What the ranks printed.
    """
    args = [json.dumps(s).replace('{out}', out) for s in scenarios]
    proc = run_torchrun([worker, out, *args], nproc=nproc, timeout=400)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return proc.stdout


def run_scenarios(run: Callable[[str, dict], None]) -> None:
    """A scenario worker's ``main``: ``argv`` is OUT_DIR, then one JSON scenario each."""
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    for arg in sys.argv[2:]:
        run(out_dir, json.loads(arg))


def run_command(cmd: Sequence[str], timeout: float = 240,
                extra_env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; kill the group if it outlives ``timeout``."""
    env = subprocess_env()
    env.update(extra_env or {})
    proc = subprocess.Popen(list(cmd), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f'{cmd} timed out after {timeout}s:\n{out[-6000:]}') from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, None)


def runner_stand_in(specs: Any = None, **attributes: Any) -> Any:
    """A stand-in for a DeepSpeedRunner in one process (no process group): ``attributes``
    and a ``strategy`` over ``specs``, what this package's hooks reach DeepSpeed through."""
    runner = SimpleNamespace(**attributes)
    runner.strategy = RunStrategy(runner, specs,  # type: ignore[arg-type]
                                  allow_unsafe_checkpoints=False, zero_init=True)
    return runner


@DATASETS.register_module()
class ToyDataset(Dataset):
    """A fixed, learnable classification problem: the label is an argmax."""

    def __init__(self, size: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.rand(size, IN_FEATURES, generator=gen)
        weight = torch.randn(IN_FEATURES, NUM_CLASSES, generator=gen)
        self.labels = (self.inputs @ weight).argmax(dim=1)
        self.metainfo: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return dict(inputs=self.inputs[index], labels=self.labels[index])


@DATASETS.register_module()
class ToyRandomDataset(ToyDataset):
    """Random augmentation as real pipelines draw it: torch, numpy and python noise per sample,
    in DataLoader workers when there are any."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        noise = (torch.randn(IN_FEATURES) * 0.05 + float(np.random.uniform(-0.05, 0.05))
                 + random.uniform(-0.05, 0.05))
        return dict(inputs=item['inputs'] + noise, labels=item['labels'])


@MODELS.register_module()
class ToyPreprocessor(BaseDataPreprocessor):
    """Moves the batch to the model's device and centres the inputs."""

    def forward(self, data: dict, training: bool = False) -> dict:
        data = self.cast_data(data)
        return dict(inputs=(data['inputs'] - 0.5) * 2.0, labels=data['labels'])


@MODELS.register_module()
class ToyModel(BaseModel):
    """MLP classifier with an optional BatchNorm and a frozen scale parameter.

    Args:
        with_bn (bool): Put a BatchNorm1d (running-stat buffers) after the
            first layer. Off for exact parity with a one-process run, since
            per-rank batch statistics differ from whole-batch ones.
            Defaults to True.
        hidden (int): Hidden width. Defaults to 16.
    """

    def __init__(self, with_bn: bool = True, hidden: int = 16,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor or dict(type='ToyPreprocessor'))
        self.fc1 = nn.Linear(IN_FEATURES, hidden)
        self.norm = nn.BatchNorm1d(hidden) if with_bn else nn.Identity()
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)
        self.frozen = nn.Parameter(torch.full((NUM_CLASSES,), 0.5), requires_grad=False)

    def init_weights(self) -> None:
        """Deterministic init, so every run of a test starts from the same point."""
        gen = torch.Generator().manual_seed(1234)
        for layer in (self.fc1, self.fc2):
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.3)
                layer.bias.zero_()

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = self.fc2(torch.relu(self.norm(self.fc1(inputs)))) + self.frozen
        if mode == 'loss':
            loss = nn.functional.cross_entropy(logits.float(), labels)
            return dict(loss=loss, acc=(logits.argmax(1) == labels).float().mean().detach())
        if mode == 'predict':
            return [dict(pred=p, label=t) for p, t in zip(logits.argmax(1), labels)]
        return logits


@MODELS.register_module()
class ToyManyTypesModel(ToyModel):
    """ToyModel with a dozen module types between its layers (LayerNorm, GELU, Dropout,
    SiLU, Sigmoid, Sequential, ModuleDict, ModuleList...), as real models have: under
    ZeRO-3 each type is another module DeepSpeed hooks, which dynamo must not compile
    once per type."""

    def __init__(self, data_preprocessor: Optional[dict] = None):
        super().__init__(with_bn=False, data_preprocessor=data_preprocessor)
        hidden = self.fc1.out_features
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            norm=nn.LayerNorm(hidden), up=nn.Linear(hidden, 2 * hidden), act=nn.GELU(),
            drop=nn.Dropout(0.0), down=nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU()),
            gate=nn.Linear(hidden, hidden), sigmoid=nn.Sigmoid(), tanh=nn.Tanh(),
            mish=nn.Mish(), softplus=nn.Softplus(), elu=nn.ELU(),
        )) for _ in range(2))

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        x = self.fc1(inputs)
        for b in self.blocks:
            h = b['drop'](b['act'](b['up'](b['norm'](x))))
            x = x + b['down'](h) * b['sigmoid'](b['gate'](x))
            x = b['elu'](b['softplus'](b['mish'](b['tanh'](x))))
        logits = self.fc2(x) + self.frozen
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits.float(), labels))
        if mode == 'predict':
            return [dict(pred=p, label=t) for p, t in zip(logits.argmax(1), labels)]
        return logits


@MODELS.register_module()
class ToyCustomStepModel(ToyModel):
    """Overrides ``train_step`` (as GANs do) and steps the optim wrapper itself."""

    def train_step(self, data: dict, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        batch = self.data_preprocessor(data, True)
        losses = self(**batch, mode='loss')
        loss, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(loss)
        log_vars['custom_step'] = torch.tensor(1.0)
        return log_vars


@MODELS.register_module()
class ToyRandomModel(ToyModel):
    """Draws random numbers on the main process's stream: dropout and ``torch.randn`` noise
    while training (as a GAN's latent or DropPath), and noise in ``predict`` too (a sampling
    model validated during training)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(0.3)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        noise = torch.randn(inputs.shape[0], 1, device=inputs.device, dtype=inputs.dtype)
        logits = super().forward(self.dropout(inputs)) + noise * 0.1
        return _outputs(logits, labels, mode)


@MODELS.register_module()
class ToyDropoutModel(ToyModel):
    """Dropout before the first layer: random numbers in training only (``predict`` draws
    none, as most models)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(0.3)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        return super().forward(self.dropout(inputs), labels, mode)


@MODELS.register_module()
class ToyFailingModel(ToyModel):
    """Raises in its training forward on one rank only (a corrupt sample there): by then
    the other ranks are on their way into DeepSpeed's gradient all-reduce.

    Args:
        fail_rank (int): The rank that raises. Defaults to 1.
        fail_iter (int): The 1-based training iteration it raises in. Defaults to 5.
        first_attempt_only (bool): Raise only before any restart by the elastic agent
            (``TORCHELASTIC_RESTART_COUNT`` 0). Defaults to False.
    """

    def __init__(self, fail_rank: int = 1, fail_iter: int = 5, first_attempt_only: bool = False,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.fail_rank, self.fail_iter = fail_rank, fail_iter
        self.first_attempt_only = first_attempt_only
        self.training_forwards = 0

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        if mode == 'loss':
            self.training_forwards += 1
            attempt = int(os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0)
            if self.training_forwards == self.fail_iter \
                    and int(os.environ.get('RANK', 0)) == self.fail_rank \
                    and not (self.first_attempt_only and attempt > 0):
                raise RuntimeError(f'corrupt sample on rank {self.fail_rank} '
                                   f'(training forward {self.fail_iter})')
        return super().forward(inputs, labels, mode)


def _outputs(logits: torch.Tensor, labels: Optional[torch.Tensor], mode: str) -> Any:
    if mode == 'loss':
        return dict(loss=nn.functional.cross_entropy(logits.float(), labels))
    if mode == 'predict':
        return [dict(pred=p, label=t) for p, t in zip(logits.argmax(1), labels)]
    return logits


@MODELS.register_module()
class ToyScalarModel(ToyModel):
    """CLIP-style 0-dim parameters: a trainable ``logit_scale`` and a frozen temperature."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.logit_scale = nn.Parameter(torch.tensor(0.3))
        self.temperature = nn.Parameter(torch.tensor(2.0), requires_grad=False)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        assert self.logit_scale.dim() == 0, self.logit_scale.shape  # as the model declared it
        logits = super().forward(inputs) * self.logit_scale.exp() / self.temperature
        return _outputs(logits, labels, mode)


@MODELS.register_module()
class ToyBranchModel(ToyModel):
    """A head run only on batches that hold the rare label 1 (as a detection head that
    sees no positive sample): in one iteration some ranks use it and others do not."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.head = nn.Linear(NUM_CLASSES, NUM_CLASSES)
        self.head_used: list[bool] = []  # per training iteration, on this rank

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = super().forward(inputs)
        if mode == 'loss':
            self.head_used.append(bool((labels == 1).any()))
            if self.head_used[-1]:
                logits = logits + self.head(logits)
        return _outputs(logits, labels, mode)


@MODELS.register_module()
class ToyLossModuleModel(ToyModel):
    """A loss term computed by a module without parameters, only on batches that hold the
    label 1: as MMDetection's bbox heads skip their loss module on a rank whose batch has
    no positive sample, so ranks run different submodules in one iteration."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.aux_loss = nn.SmoothL1Loss()
        self.head_used: list[bool] = []

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = super().forward(inputs)
        if mode != 'loss':
            return _outputs(logits, labels, mode)
        losses = dict(loss=nn.functional.cross_entropy(logits.float(), labels))
        positive = labels == 1
        self.head_used.append(bool(positive.any()))
        if self.head_used[-1]:
            losses['loss_aux'] = self.aux_loss(logits[positive, 1], torch.ones_like(
                logits[positive, 1]))
        else:
            losses['loss_aux'] = logits.sum() * 0
        return losses


@MODELS.register_module()
class ToyValuesModel(ToyLossModuleModel):
    """Reads values while it is built (as SegFormer's backbone reads its drop-path rates with
    ``.item()``) and while it runs (the loss module's branch): the meta device can do neither,
    so the training log's plan prediction is measured."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.aux_weight = float(torch.linspace(0, 2, 3)[1].item())


@METRICS.register_module()
class ToyAccuracy(BaseMetric):
    """Accuracy over the whole validation set (gathered across ranks)."""

    def process(self, data_batch: Any, data_samples: Sequence[dict]) -> None:
        for sample in data_samples:
            self.results.append(float(sample['pred'] == sample['label']))

    def compute_metrics(self, results: list) -> dict[str, float]:
        return dict(accuracy=sum(results) / max(len(results), 1))


def toy_config(work_dir: str, *, ds_config: Optional[dict] = None, max_iters: int = 8,
               batch_size: int = 4, by_epoch: bool = False, max_epochs: int = 2,
               optimizer: Optional[dict] = None, accumulative_counts: Optional[int] = None,
               clip_grad: Optional[dict] = None, paramwise_cfg: Optional[dict] = None,
               model: Optional[dict] = None, with_bn: bool = True,
               param_scheduler: Any = 'default', val: bool = True,
               dataset_size: int = 32, seed: int = 42, checkpoint: Optional[dict] = None,
               dataset_type: str = 'ToyDataset', num_workers: int = 0,
               persistent_workers: bool = False,
               val_interval: Optional[int] = None,
               **extra: Any) -> dict:
    """A complete MMEngine runner config for the toy problem.

    ``checkpoint`` configures CheckpointHook (off by default); ``dataset_type``,
    ``num_workers`` and ``persistent_workers`` the training data; ``extra``
    keys (``resume``, ``load_from``...) are added to the config as they are.

    Returns:
        dict: Keyword arguments of ``Runner`` (``cfg`` style).
    """
    optim_wrapper: dict = dict(type='OptimWrapper',
                               optimizer=optimizer or dict(type='SGD', lr=0.1, momentum=0.9))
    if accumulative_counts is not None:
        optim_wrapper['accumulative_counts'] = accumulative_counts
    if clip_grad is not None:
        optim_wrapper['clip_grad'] = clip_grad
    if paramwise_cfg is not None:
        optim_wrapper['paramwise_cfg'] = paramwise_cfg
    if param_scheduler == 'default':
        param_scheduler = [
            dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0, end=3),
            dict(type='MultiStepLR', milestones=[5], gamma=0.5, by_epoch=False),
        ]
    train_cfg = (dict(by_epoch=True, max_epochs=max_epochs, val_interval=val_interval or 1)
                 if by_epoch else
                 dict(by_epoch=False, max_iters=max_iters, val_interval=val_interval or max_iters))
    cfg: dict = dict(
        model=model or dict(type='ToyModel', with_bn=with_bn),
        work_dir=work_dir,
        train_dataloader=dict(
            batch_size=batch_size, num_workers=num_workers,
            persistent_workers=persistent_workers,
            dataset=dict(type=dataset_type, size=dataset_size),
            sampler=dict(type='DefaultSampler', shuffle=True, seed=seed),
            collate_fn=dict(type='default_collate')),
        train_cfg=train_cfg,
        optim_wrapper=optim_wrapper,
        param_scheduler=param_scheduler,
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1), checkpoint=checkpoint),
        custom_hooks=[dict(type='RecorderHook')],
        randomness=dict(seed=seed),
        log_level='WARNING',
        env_cfg=dict(dist_cfg=dict(backend='gloo', timeout=60)),
    )
    if val:
        cfg.update(
            val_dataloader=dict(
                batch_size=4, num_workers=0, dataset=dict(type='ToyDataset', size=16, seed=1),
                sampler=dict(type='DefaultSampler', shuffle=False),
                collate_fn=dict(type='default_collate')),
            val_cfg=dict(),
            val_evaluator=dict(type='ToyAccuracy'))
    if ds_config is not None:
        cfg['ds_config'] = ds_config
    if param_scheduler is None:
        cfg.pop('param_scheduler')
    cfg.update(extra)
    return cfg


def probe_inputs() -> torch.Tensor:
    """A fixed batch for comparing model outputs across runs."""
    return torch.rand(5, IN_FEATURES, generator=torch.Generator().manual_seed(99))


def ema_state(runner: Any) -> Optional[dict[str, torch.Tensor]]:
    """The averaged weights of the runner's EMA hook, if it has one."""
    for hook in runner.hooks:
        if hasattr(hook, 'ema_model'):
            return model_state(hook.ema_model.module)
    return None


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as fp32 CPU tensors."""
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


@HOOKS.register_module()
class RecorderHook(Hook):
    """Records the loss and learning rate of every iteration, the val metrics, and how many
    graphs torch.compile has built in this process after each iteration."""

    priority = 'VERY_LOW'

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.metrics: list[dict] = []
        self.compiled_graphs: list[int] = []

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        assert outputs is not None
        self.losses.append(float(outputs['loss'].detach()))
        self.lrs.append(float(runner.optim_wrapper.get_lr()['lr'][0]))
        self.compiled_graphs.append(dynamo_counts()['graphs'])

    def after_val_epoch(self, runner: Any, metrics: Optional[dict] = None) -> None:
        self.metrics.append({k: float(v) for k, v in (metrics or {}).items()})


def recorder(runner: Any) -> RecorderHook:
    """The runner's RecorderHook."""
    return next(h for h in runner.hooks if isinstance(h, RecorderHook))


# the engine wrapper's forward, as the doubles below replace it
_RUN_FORWARD = DeepSpeedEngineWrapper._run_forward
OUT_OF_MEMORY_RAISED = [0]  # by forward_doubles, since a run's doubles were installed




def forward_doubles(out_of_memory: Optional[dict], collective: bool) -> None:
    """Test doubles in the training forward. ``out_of_memory`` (given on rank 1 only):
    CUDA's allocator running out of memory (on the CPU torch raises no
    ``torch.OutOfMemoryError``: the OS ends the process): ``{'at': [n, ...], 'in':
    'forward' | 'backward'}``, the n-th training forward (from 1) of a micro-batch of more
    than one sample raises it at the end of that forward, or in its backward; ``{'at':
    'every'}``, every training forward raises it (nothing fits, even one sample).
    ``collective``: every forward then all-reduces, as a loss averaging its positives over
    ranks does (MMDetection's ``reduce_mean``). Neither: the real forward (a previous
    scenario's doubles undone)."""
    OUT_OF_MEMORY_RAISED[0] = 0
    if out_of_memory is None and not collective:
        DeepSpeedEngineWrapper._run_forward = _RUN_FORWARD  # type: ignore[method-assign]
        return
    forwards = [0]

    def raise_out_of_memory(*_: Any) -> None:
        OUT_OF_MEMORY_RAISED[0] += 1
        raise torch.OutOfMemoryError('CUDA out of memory (a test double on rank 1)')

    def run_forward(self: Any, batch: Any, mode: str) -> Any:
        losses = _RUN_FORWARD(self, batch, mode)
        if mode != 'loss':
            return losses
        if out_of_memory is not None and out_of_memory['at'] == 'every':
            raise_out_of_memory()
        if out_of_memory is not None and len(batch['inputs']) > 1:
            forwards[0] += 1
            if forwards[0] in out_of_memory['at']:
                if out_of_memory['in'] == 'forward':
                    raise_out_of_memory()
                losses['loss'].register_hook(raise_out_of_memory)
        if collective:
            torch.distributed.all_reduce(torch.zeros(1))
        return losses

    DeepSpeedEngineWrapper._run_forward = run_forward  # type: ignore[method-assign]
