"""DeepSpeedEngineWrapper: the model wrapper MMEngine's loops talk to.

The loops call ``runner.model.train_step / val_step / test_step``; hooks reach
the user's model as ``runner.model.module``. The wrapper runs the BaseModel's
data preprocessor, casts floating inputs to the engine's dtype under bf16/fp16
and forwards through the DeepSpeed engine, so ZeRO-3's parameter gathering and
the engine's bookkeeping see every step. Nothing is patched onto the engine.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union, cast

import torch
from deepspeed import DeepSpeedEngine
from mmengine.model import BaseDataPreprocessor, BaseModel
from mmengine.optim import OptimWrapper
from mmengine.registry import MODEL_WRAPPERS
from mmengine.structures import BaseDataElement
from torch import nn
from typing_extensions import override

from ..zero.gather import whole_copy
from ..zero.released_guard import ReleasedGuard
from .split_retry import SplitRetry
from .virtual_ranks import MicroBatches, VirtualRanks

Data = Union[dict, tuple, list]


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Cast the floating tensors in ``data`` to ``dtype``.

    Containers (dict, list, tuple) are walked; data samples
    (``BaseDataElement``) are left alone, since their floating fields are
    labels and targets that must keep full precision.

    Args:
        data (Any): Output of the data preprocessor.
        dtype (torch.dtype): The engine's compute dtype.

    Returns:
        Any: ``data`` with floating tensors cast.
    """
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, BaseDataElement):
        return data
    if isinstance(data, Mapping):
        return type(data)({k: cast_floating(v, dtype) for k, v in data.items()})  # type: ignore
    if isinstance(data, tuple) and hasattr(data, '_fields'):  # namedtuple
        return type(data)(*(cast_floating(v, dtype) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(cast_floating(v, dtype) for v in data)
    return data


def overrides(module: nn.Module, method: str) -> bool:
    """Whether ``module`` replaces BaseModel's ``method`` with its own."""
    if not isinstance(module, BaseModel):
        return True
    return getattr(type(module), method) is not getattr(BaseModel, method)


def mean_log_vars(logged: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch's log variables from its equal micro-batches' (each the mean of its
    samples'): the mean of each key over the micro-batches that logged it (a conditional
    branch may log a key in some only). On the device: nothing is read."""
    if len(logged) == 1:
        return logged[0]
    keys = dict.fromkeys(key for log_vars in logged for key in log_vars)
    return {key: cast(torch.Tensor, sum(values)) / len(values) for key in keys
            for values in [[log_vars[key] for log_vars in logged if key in log_vars]]}


@MODEL_WRAPPERS.register_module()
class DeepSpeedEngineWrapper(nn.Module):
    """Wraps the DeepSpeed engine(s) so MMEngine's loops and hooks can drive them.

    Args:
        engines (Mapping[str, DeepSpeedEngine]): Every engine by name: one
            around the whole model, or (with ``model``) one per optimizer
            around its submodule.
        cast_dtype (torch.dtype, optional): Dtype floating inputs are cast to
            before the forward pass (bf16/fp16 training); None keeps them.
            Defaults to None.
        model (nn.Module, optional): For a model with several optimizers, the
            whole model, whose own ``train_step`` calls its submodules. None:
            the one engine holds the whole model and the steps forward
            through it. Defaults to None.
    """

    _whole_model: Optional[nn.Module]
    _user_model: nn.Module
    _forward_target: nn.Module
    _own_steps: dict[str, bool]
    # a layout's virtual ranks on this rank (config/layout.py), set with the engines
    virtual_ranks: Optional[VirtualRanks] = None
    # its retry of an 'auto' split on an out-of-memory error (engine/split_retry.py)
    split_retry: Optional[SplitRetry] = None

    def __init__(self, engines: Mapping[str, DeepSpeedEngine],
                 cast_dtype: Optional[torch.dtype] = None, model: Optional[nn.Module] = None):
        super().__init__()
        self.engines = dict(engines)
        self.cast_dtype = cast_dtype
        if model is None:
            (self.engine,) = self.engines.values()  # a submodule: parameters() reach the model
        # Plain attributes, not submodules (object.__setattr__ passes nn.Module's
        # registration by): the engines own the parameters and ZeRO-3's hooks, and a
        # submodule would put the model in state_dict() a second time.
        unregistered = {
            '_whole_model': model,
            '_user_model': model if model is not None else self.engine.module,
            # what the steps call, decided once for the wrapper's life
            '_forward_target': self.engine if model is None else model,
        }
        for name, value in unregistered.items():
            object.__setattr__(self, name, value)
        self._own_steps = {method: overrides(self._user_model, method)
                           for method in ('train_step', 'val_step', 'test_step')}
        preprocessor = getattr(self.module, 'data_preprocessor', None)
        device = {engine.device for engine in self.engines.values()}.pop()
        if isinstance(preprocessor, BaseDataPreprocessor) and preprocessor.device != device:
            preprocessor.to(device)

    @property
    def module(self) -> nn.Module:
        """The user's model, for hooks and for code written for DDP."""
        return self._user_model

    @override
    def __getattr__(self, name: str) -> Any:
        """The wrapper's own attributes, else the user's model's (``runner.model.backbone``),
        as the bare model in one process and DeepSpeed's own engine give them."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith('__') or '_user_model' not in self.__dict__:
                raise
            return getattr(self.module, name)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """The user's model, copied with its weights as they are (see :func:`whole_copy`).

        An engine holds process groups, which cannot be copied; code that
        deep-copies a wrapped model (a custom EMA, a distillation teacher, a
        TTA wrapper) wants the model. The copy is plain: not partitioned,
        not wrapped, not stepped by DeepSpeed.
        """
        copied = whole_copy(self.module)
        memo[id(self)] = copied
        return copied

    @override
    def train(self, mode: bool = True) -> DeepSpeedEngineWrapper:
        """Set training mode on every engine and the whole model (MMEngine's iteration loop
        calls it every iteration: the model's tree is walked once, as DDP's would be)."""
        super().train(mode)  # one engine: a submodule, whose train() sets the model's
        if self._whole_model is not None:  # several: not submodules
            self.module.train(mode)
            for engine in self.engines.values():
                engine.train(mode)
        return self

    def train_step(self, data: Data, optim_wrapper: OptimWrapper) -> dict[str, torch.Tensor]:
        """Preprocess, forward in ``'loss'`` mode, parse losses, update.

        A model that overrides ``train_step`` (GANs, custom schedules) has its
        own called with the DeepSpeed optim wrapper instead.

        Args:
            data (dict | tuple | list): A batch from the dataloader.
            optim_wrapper (OptimWrapper): The runner's DeepSpeedOptimWrapper.

        Returns:
            dict[str, torch.Tensor]: Log variables from ``parse_losses``.
        """
        if isinstance(data, MicroBatches):
            return self._micro_steps(data, optim_wrapper)
        module = self._user_model
        if self._own_steps['train_step']:
            return getattr(module, 'train_step')(data, optim_wrapper)  # noqa: B009
        if len(self.engines) > 1:
            raise TypeError(
                f'{type(module).__name__} has several optimizers ({", ".join(self.engines)}) '
                'but no train_step of its own: BaseModel.train_step steps one optimizer. Override '
                "train_step and step each wrapper (optim_wrapper['generator'].update_params(...)), "
                "as in MMEngine's GAN example.")
        assert isinstance(module, BaseModel)
        with optim_wrapper.optim_context(self):
            batch = module.data_preprocessor(data, True)
            losses = self._run_forward(batch, mode='loss')
        parsed_losses, log_vars = module.parse_losses(losses)
        if self.split_retry is not None:
            self.split_retry.before_backward()
        optim_wrapper.update_params(parsed_losses)
        return log_vars

    def _micro_steps(self, batches: MicroBatches,
                     optim_wrapper: OptimWrapper) -> dict[str, torch.Tensor]:
        """One iteration of a layout: each virtual rank's micro-batches micro-steps, under
        its own random streams and buffers; the log shows the first's (rank 0's, in the
        N-rank run's log: over its micro-batches, the mean). Under an 'auto' split's
        retry, tried first (:class:`SplitRetry`)."""
        if self.split_retry is not None:
            return self.split_retry.run(
                batches, lambda pieces: self._in_turn(pieces, optim_wrapper))
        return self._in_turn(batches, optim_wrapper)

    def _in_turn(self, batches: MicroBatches,
                 optim_wrapper: OptimWrapper) -> dict[str, torch.Tensor]:
        virtual = self.virtual_ranks
        if virtual is None or len(batches) != virtual.micro_steps:
            raise RuntimeError(f'{len(batches)} micro-batches reached a model set up for '
                               f'{virtual.micro_steps if virtual else "no"} (virtual ranks x '
                               'micro-batches).')
        split = virtual.split
        return virtual.run_in_turn(
            [batches[at:at + split] for at in range(0, len(batches), split)],
            lambda own: mean_log_vars([self.train_step(batch, optim_wrapper) for batch in own]))

    def val_step(self, data: Data) -> list:
        """Preprocess and forward in ``'predict'`` mode (or the model's own)."""
        return self._predict(data, 'val_step')

    def test_step(self, data: Data) -> list:
        """Preprocess and forward in ``'predict'`` mode (or the model's own)."""
        return self._predict(data, 'test_step')

    def _predict(self, data: Data, method: str) -> list:
        module = self.module
        if self._own_steps[method]:
            return getattr(module, method)(data)
        assert isinstance(module, BaseModel)
        batch = module.data_preprocessor(data, False)
        return self._run_forward(batch, mode='predict')

    def _run_forward(self, batch: Data, mode: str) -> Any:
        if self.cast_dtype is not None:
            batch = cast_floating(batch, self.cast_dtype)
        # Several engines: the submodules are called (and cast) by the model.
        forward = self._forward_target
        if isinstance(batch, Mapping):
            return forward(**batch, mode=mode)
        if isinstance(batch, (list, tuple)):
            return forward(*batch, mode=mode)
        raise TypeError(
            f'The data_preprocessor must return a dict, tuple or list, got {type(batch)}.')

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through the engine (for code that calls the model itself).

        Floating inputs are cast to the engine's dtype, as in the steps.
        """
        if self.cast_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self.cast_dtype)
        return self._forward_target(*args, **kwargs)


def released_guard(model: nn.Module) -> AbstractContextManager:
    """:class:`~..zero.released_guard.ReleasedGuard` over the user's model, where ``model``
    (``runner.model``) wraps a ZeRO-3 engine that is not compiled (dynamo does not compile
    under a dispatch mode: the guard would move compilation to the next iteration); else a
    block that does nothing. The train loop's first iteration and ``before_train`` run in it.
    """
    if isinstance(model, DeepSpeedEngineWrapper):
        engines = model.engines.values()
        if any(e.zero_optimization_stage() == 3 for e in engines) and \
                not any(e.is_compiled for e in engines):
            return ReleasedGuard(model.module)
    return nullcontext()
