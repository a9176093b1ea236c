"""Activation memory of one training step, from one real batch of the train dataloader.

The model's own ``train_step`` runs on the meta-device model with the batch
as the loop hands it over; its ``data_preprocessor`` runs for real (built on
the CPU from the config) and hands meta tensors on. Every tensor autograd
saves for backward is counted by its storage's size, none is allocated; the
optim wrappers are stand-ins that count each forward up to its backward.
Modules the config lists under ``activation_checkpointing`` are checkpointed
as training checkpoints them (only their inputs are saved).
Integer step counters (``BaseAveragedModel.steps``) are real zeros, as at a
run's first iteration. A step whose shapes or branches depend on values
(MMDetection's assigners call ``.item()``, MMSegmentation's losses
``torch.nonzero``) cannot run on the meta device: it is measured instead, the
model built for real in this process and one real training step taken on the
CPU at a small micro-batch (:data:`PROBE_SAMPLES`), scaled to the run's.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from mmengine.config import Config
from mmengine.logging import MessageHub
from mmengine.optim import OptimWrapper
from mmengine.registry import MODELS
from mmengine.runner import Runner
from mmengine.runner.activation_checkpointing import turn_on_activation_checkpointing
from torch import nn
from typing_extensions import override

from ..compat import TO_COPY, TorchDispatchMode
from ..engine.activation import checkpointed_modules
from ..engine.spec import SINGLE_ENGINE
from ..zero.partitioned import model_frame
from .census import construction_note, on_meta, streams_kept
from .saved import SavedTensorCounter
from .transients import BroadcastOperands, copies_broadcast


@dataclass
class Activations:
    """What one training step saves for backward at ``micro_batch`` samples.

    Args:
        float_bytes (int): Bytes of floating tensors, as traced in the model's
            own dtype (scaled to the compute dtype by the planner).
        other_bytes (int): Bytes of integer and boolean tensors (indices, masks).
        float_size (int): Element size the floating tensors were traced in.
        micro_batch (int): Samples in the traced batch.
        method (str): ``'traced'`` (meta device), ``'probe'`` (a real step in
            ``plan``) or ``'measured'`` (a training run's first step).
        note (str, optional): For a probe, what in the model's code needs values
            (the meta device has none), or why the model was built for real.
        broadcast (int): Elements of the largest operand a batched matmul of the step
            reads broadcast (:class:`~.transients.BroadcastOperands`), which the CPU's
            bf16 matmuls through oneDNN copy whole for the call.
    """

    float_bytes: int
    other_bytes: int
    float_size: int
    micro_batch: int
    method: str
    note: Optional[str] = None
    broadcast: int = 0

    def bytes_at(self, micro_batch: int, element_size: int) -> float:
        """Saved bytes at ``micro_batch`` samples with floats of ``element_size`` bytes."""
        scale = micro_batch / self.micro_batch
        return scale * (self.float_bytes * element_size / self.float_size + self.other_bytes)

    def transient_at(self, micro_batch: int, element_size: int, cuda: bool) -> float:
        """Bytes one kernel call takes beyond what is saved: a broadcast operand that the
        CPU's bf16 ``bmm`` copies (:func:`~.transients.copies_broadcast`). Its batch is the
        input's leading dimension, the micro-batch or another, so it is scaled up with a
        larger micro-batch, never down."""
        if not copies_broadcast(cuda, element_size):
            return 0.0
        return max(1.0, micro_batch / self.micro_batch) * self.broadcast * element_size


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if hasattr(value, 'to') and callable(value.to):  # MMEngine's data elements
        return value.to(device)
    return value


class _OnMeta(nn.Module):
    """The config's data_preprocessor, run for real on the CPU, its output moved to meta."""

    def __init__(self, preprocessor: nn.Module):
        super().__init__()
        self.preprocessor = preprocessor

    @override
    def forward(self, data: Any, training: bool = False) -> Any:
        return _to(self.preprocessor(data, training), 'meta')


class _StandIn(OptimWrapper):
    """The optim wrapper(s) ``train_step`` is given on the meta device: each
    ``update_params`` (or ``backward``) stands in for the backward that would free
    that forward's saved tensors before the step's next forward (a GAN runs several).
    MMEngine's ``OptimWrapper`` (over an optimizer of nothing), so that a ``train_step``
    that reads a wrapper's state (MMagic's ``BaseGAN`` reads ``_accumulative_counts`` and
    calls ``initialize_count_status``) finds what a real one has."""

    def __init__(self, counter: SavedTensorCounter):
        super().__init__(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0))
        self.counter = counter

    @override
    @contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        yield

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.counter.release_all()

    @override
    def update_params(self, loss: torch.Tensor, step_kwargs: Optional[dict] = None,
                      zero_kwargs: Optional[dict] = None) -> None:
        self.counter.release_all()

    @override
    def step(self, **kwargs: Any) -> None:
        """Nothing to step: only activations are counted."""

    @override
    def zero_grad(self, **kwargs: Any) -> None:
        """Nothing to clear."""


@contextmanager
def _at_first_iteration() -> Iterator[None]:
    """The current MessageHub's ``iter`` is 0 where no loop set it (``plan`` has no runner):
    a ``train_step`` that reads it (MMagic's ``BaseGAN``) steps as at the first iteration."""
    hub = MessageHub.get_current_instance()
    missing = hub.get_info('iter') is None
    if missing:
        hub.update_info('iter', 0)
    try:
        yield
    finally:
        if missing:
            hub.pop_info('iter')


def one_batch(cfg: Config, samples: Optional[int] = None) -> Any:
    """One batch of the config's train dataloader, as the loop hands it to ``train_step``;
    ``samples``: of that many samples instead of the config's ``batch_size``."""
    loader_cfg = copy.deepcopy(cfg.get('train_dataloader'))
    if not isinstance(loader_cfg, dict):
        raise ValueError('plan needs the config\'s train_dataloader (one batch is traced).')
    if samples is not None:
        loader_cfg['batch_size'] = samples
    loader_cfg['num_workers'] = 0
    loader_cfg.pop('persistent_workers', None)
    return next(iter(Runner.build_dataloader(loader_cfg, seed=0)))


def _to_meta(value: Any) -> Any:
    """``value`` with its tensors of one element or more on the meta device (0-dim CPU
    tensors mix with any device, as torch allows)."""
    if isinstance(value, torch.Tensor):
        return value.to('meta') if value.dim() and not value.is_meta else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(item) for item in value)
    return value


def _has_meta(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta
    return isinstance(value, (list, tuple)) and any(_has_meta(item) for item in value)


class _KeptOnMeta(TorchDispatchMode):
    """The traced step stays on the meta device where model code moves or mixes tensors by
    device: MMagic's generators put their noise on ``get_module_device(self)``, which is
    the CPU for a model that is not on CUDA (``.to('cpu')`` of a meta tensor cannot copy
    data that does not exist), and a tensor made without a device (``torch.randn(shape)``)
    meets the meta model's outputs. An op with a meta operand runs on the meta device."""

    @override
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if _has_meta(args) or _has_meta(list(kwargs.values())):
            if func is TO_COPY:
                kwargs['device'] = torch.device('meta')
            else:
                args = _to_meta(args)
                kwargs = {key: _to_meta(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)


def _counters_at_zero(model: nn.Module) -> None:
    """Each integer 0-dim buffer on the meta device (a step counter: MMEngine's
    ``BaseAveragedModel.steps``, BatchNorm's ``num_batches_tracked``) made a real zero on
    the CPU, as at a run's first iteration: a step that branches on it
    (``if self.steps == 0``, BYOL's target update) traces instead of reading a meta value."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta and buffer.dim() == 0 and not buffer.is_floating_point():
                setattr(module, name, torch.zeros((), dtype=buffer.dtype))


def _count(model: nn.Module, batch: Any, checkpointed: list[str],
           engines: list[str]) -> tuple[int, int, int]:
    """(float bytes, other bytes) one ``train_step`` saves for backward at most at once,
    and the largest broadcast operand of a batched matmul in it (elements)."""
    if checkpointed:
        turn_on_activation_checkpointing(model, checkpointed)
    model.train()
    _counters_at_zero(model)
    counter = SavedTensorCounter(model)
    stand_in = _StandIn(counter)
    wrapper: Any = stand_in if engines == [SINGLE_ENGINE] else {name: stand_in for name in engines}
    broadcast = BroadcastOperands()
    # what the step draws (a GAN's torch.randn noise is made on the CPU, without a device)
    # comes from forked streams: the training log traces inside the run, whose random numbers
    # must be the ones Runner draws
    with streams_kept(), counter.hooks(), broadcast, _KeptOnMeta(), _at_first_iteration():
        model.train_step(batch, wrapper)  # type: ignore[operator]  # a BaseModel
    return (*counter.peak, broadcast.largest)



# Samples in a probe's real step: two, not one, so that BatchNorm after pooling (a
# projection neck's BatchNorm1d) still has more than one value per channel
PROBE_SAMPLES = 2


def _needs(error: Exception) -> str:
    """What a step that cannot run on the meta device needs there, and where."""
    text = str(error)
    need = ('reads a tensor\'s value' if 'item()' in text else
            'has shapes that depend on values' if 'nonzero' in text else
            f'needs values ({type(error).__name__})')
    return f'its step {need} at {model_frame(error)}'


def _probe(cfg: Config, model: nn.Module, micro_batch: int, checkpointed: list[str],
           engines: list[str], float_size: int, why: str) -> Activations:
    """One real training step of ``model`` (built for real) at :data:`PROBE_SAMPLES`
    samples, or the run's micro-batch where that is smaller: :meth:`Activations.bytes_at`
    scales it. Images padded to the largest of a batch make a larger batch save slightly
    more per sample."""
    samples = min(micro_batch, PROBE_SAMPLES)
    floats, others, broadcast = _count(model, one_batch(cfg, samples), checkpointed, engines)
    return Activations(floats, others, float_size, samples, 'probe', why, broadcast)


def trace_activations(cfg: Config, model: nn.Module, batch: Any, micro_batch: int,
                      engines: list[str], probe: bool = True) -> Activations:
    """Count what one training step saves, on the meta-device ``model``; probe when it cannot.

    Args:
        cfg (Config): The training config (its model, data_preprocessor,
            activation_checkpointing).
        model (nn.Module): The config's model on the meta device (used up: hooks,
            checkpoint wrappers).
        batch (Any): :func:`one_batch`.
        micro_batch (int): Samples in ``batch``.
        engines (list[str]): The engines' names (the optim wrappers ``train_step`` gets).
        probe (bool): Where tracing cannot run, measure one real step (else raise).
    """
    checkpointed = [name for name, _ in checkpointed_modules(
        model, cfg.get('activation_checkpointing'))]
    float_size = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    if not on_meta(model):  # its construction needed values: built for real already
        if not probe:
            raise RuntimeError(construction_note(model) or 'the model is not on the meta device')
        return _probe(cfg, model, micro_batch, checkpointed, engines, float_size,
                      construction_note(model) or 'the model was built for real')
    preprocessor_cfg = cfg.model.get('data_preprocessor')
    if preprocessor_cfg is not None:
        model.data_preprocessor = _OnMeta(MODELS.build(preprocessor_cfg))
    else:  # the one the model builds itself (mmdet's, mmpretrain's...), on the meta device
        model.data_preprocessor.to('meta')
    try:
        floats, others, broadcast = _count(model, batch, checkpointed, engines)
        return Activations(floats, others, float_size, micro_batch, 'traced', None, broadcast)
    except Exception as e:  # any forward may need values the meta device lacks
        if not probe:
            raise
        why = _needs(e)
    return _probe(cfg, MODELS.build(cfg.model), micro_batch, checkpointed, engines,
                  float_size, why)
