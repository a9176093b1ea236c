"""The model of a config, counted without its weights: parameters, engines, optimizer states.

The model is built on the meta device (shapes and dtypes, no storage), and
MMEngine's own optimizer factory builds the config's optimizer(s) on it, so
``paramwise_cfg``, frozen parameters and several optimizers (one engine
each, as the runner builds them) are counted as training will see them.
"""
from __future__ import annotations

import importlib.util
import inspect
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from mmengine.config import Config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import DATASETS, MODELS, TRANSFORMS, init_default_scope
from torch import nn
from torch.optim import Optimizer

from ..compat import full_numel
from ..config.model_settings import largest_layer
from ..engine.build import owned_submodules
from ..engine.spec import as_plain_wrappers, named_optimizers
from ..zero.in_step import averaged_models
from ..zero.partitioned import construction_failure

# fp32 values per trained element, for optimizers a one-element step cannot
# count here (DeepSpeed's fused and CPU optimizers need their compiled ops).
KNOWN_STATES = {'adam': 2, 'lamb': 2, 'lion': 1, 'adagrad': 1, 'muon': 1}


@dataclass
class EngineCensus:
    """What one engine holds and steps.

    Args:
        name (str): The engine's name (``'model'`` for one optimizer).
        path (str): The submodule it is built around (``''``: the model).
        numels (list[int]): Every parameter's number of elements.
        trainable (int): Elements its optimizer steps.
        dtypes (dict[str, int]): Elements by dtype as built.
        largest_layer (int): The most parameters one module holds itself.
        optimizer (str): The optimizer's class name ('' without one).
        states (int): fp32 values the optimizer keeps per trained element.
        states_note (str, optional): How ``states`` was found, when assumed.
        averaged (int): Elements of the averaged models the model updates in its own
            step (BYOL's target): under ZeRO-3 each update gathers them and their
            source whole (zero/in_step.py). Defaults to 0.
    """

    name: str
    path: str
    numels: list[int]
    trainable: int
    dtypes: dict[str, int]
    largest_layer: int
    optimizer: str = ''
    states: int = 0
    states_note: Optional[str] = None
    averaged: int = 0

    @property
    def params(self) -> int:
        """All parameters of the engine's module."""
        return sum(self.numels)

    @property
    def frozen(self) -> int:
        """Parameters no optimizer steps (they stay in the compute dtype)."""
        return self.params - self.trainable

    def at_most(self, threshold: int) -> int:
        """Elements of the parameters of at most ``threshold`` elements each."""
        return sum(n for n in self.numels if n <= threshold)


def import_scope(scope: Optional[str]) -> None:
    """Import what building a model and its data from ``scope``'s registries imports.

    A library's models and datasets (about 110 MiB of RSS for MMDetection or
    MMPretrain): ``plan``'s fixed cost has them, and so must the training log's, which
    is taken before the runner builds anything. A scope without an installed
    ``<scope>.registry`` (OpenMMLab's layout) imports nothing here (MMEngine warns about
    it when it builds).
    """
    if not scope or scope == 'mmengine' or importlib.util.find_spec(scope) is None \
            or importlib.util.find_spec(f'{scope}.registry') is None:
        return
    for registry in (MODELS, DATASETS, TRANSFORMS):
        with registry.switch_scope_and_registry(scope) as scoped:
            scoped.import_from_location()


def meta_model(cfg: Config, for_real: bool = True) -> nn.Module:
    """The config's model on the meta device (no weight allocated, no init run).

    Where its construction needs values (``torch.linspace(...).item()`` for
    SegFormer's drop-path rates, say), the model is built for real on the CPU
    instead, and :func:`construction_note` says so.

    Args:
        cfg (Config): The training config.
        for_real (bool): Build it for real where the meta device fails; False
            raises instead (inside training, where a second model would raise
            the memory being predicted). Defaults to True.
    """
    init_default_scope(cfg.get('default_scope') or 'mmengine')
    model_cfg = cfg.get('model')
    if not isinstance(model_cfg, dict):
        raise ValueError('plan needs the config\'s "model" as a dict (type=...), as '
                         'tools/train.py builds it.')
    try:
        with torch.device('meta'):
            return MODELS.build(model_cfg)
    except Exception:  # model code that reads values while it is built: see below
        pass
    try:
        with streams_kept(), parameters_on_meta():
            return MODELS.build(model_cfg).to('meta')
    except Exception as e:  # it reads its own parameters' values
        if not for_real:
            raise
        model = MODELS.build(model_cfg)
        model.plan_construction_note = (
            f'building the model on the meta device failed ({construction_failure(e)}); it '
            'was built for real in this process instead')
        return model


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Each parameter moved to the meta device as a module registers it (Accelerate's
    ``init_empty_weights``, with MMEngine's models in mind): construction code that reads
    values of other tensors (MMPretrain's ResNet and MMSegmentation's MiT take their
    drop-path rates from ``torch.linspace(...).item()``) runs on the CPU, and no more than
    one layer's weights is allocated at a time. Where ``torch.device('meta')`` builds the
    model, :func:`meta_model` uses that (no allocation, no initialisation at all)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:  # registered again below, on meta
            param = type(param)(param.detach().to('meta'), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextmanager
def streams_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU, and CUDA where in use) random streams as they
    were before the block, whatever it drew: the training log sizes its model inside the
    run, whose random numbers must be the ones Runner draws."""
    python, numpy = random.getstate(), np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def construction_note(model: nn.Module) -> Optional[str]:
    """Why :func:`meta_model` built ``model`` for real (None: it is on the meta device)."""
    return getattr(model, 'plan_construction_note', None)


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def optimizer_states(optimizer: Optimizer) -> tuple[int, Optional[str]]:
    """fp32 values ``optimizer`` keeps per element: one step of its class on 8 elements.

    Returns:
        tuple[int, str | None]: The count, and a note when it was assumed.
    """
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    options = {k: v for k, v in group.items() if k != 'params' and k in accepted}
    probe = torch.zeros(8, requires_grad=True)
    try:
        stepper = cls([probe], **options)
        probe.grad = torch.ones(8)
        stepper.step()
        return sum(v.numel() // 8 for v in stepper.state[probe].values()
                   if isinstance(v, torch.Tensor) and v.numel() >= 8), None
    except Exception as e:  # any optimizer may refuse to run here
        name = cls.__name__.lower()
        states = next((n for key, n in KNOWN_STATES.items() if key in name), 2)
        return states, (f'{cls.__name__} could not step here ({type(e).__name__}); '
                        f'assumed {states} state(s) per element')


def census(cfg: Config, model: nn.Module) -> list[EngineCensus]:
    """One :class:`EngineCensus` per engine the runner would build for ``cfg``'s training.

    ``model`` is the config's model on the meta device, or a real one (ZeRO-3's
    partitioned parameters count whole): MMEngine's factory only groups its
    parameters, no optimizer state is allocated.
    """
    optim_cfg = cfg.get('optim_wrapper')
    if optim_cfg is None:
        raise ValueError('plan needs the config\'s optim_wrapper (what training steps).')
    optimizers = named_optimizers(build_optim_wrapper(model, as_plain_wrappers(optim_cfg)))
    engines = []
    for name, path in owned_submodules(model, optimizers).items():
        module = model.get_submodule(path) if path else model
        optimizer = optimizers[name]
        stepped = {id(p) for g in optimizer.param_groups for p in g['params'] if p.requires_grad}
        params = list(module.parameters())
        states, note = optimizer_states(optimizer)
        engines.append(EngineCensus(
            name=name, path=path, numels=[full_numel(p) for p in params],
            trainable=sum(full_numel(p) for p in params if id(p) in stepped),
            dtypes=dict(_by_dtype(params)),
            largest_layer=largest_layer(module),
            optimizer=type(optimizer).__name__, states=states, states_note=note,
            averaged=sum(full_numel(p) for m in averaged_models(module)
                         for p in m.parameters())))
    return engines


def _by_dtype(params: list[Any]) -> Counter:
    counts: Counter = Counter()
    for p in params:
        counts[str(p.dtype).replace('torch.', '')] += full_numel(p)
    return counts
