"""EMAHook for DeepSpeed engines: averages the full fp32 weights under ZeRO 0-3.

MMEngine's ``EMAHook`` deep-copies ``runner.model.module`` and reads its
parameters every iteration. Under ZeRO-3 those parameters are empty
partitions, under bf16 they are bf16, and its checkpoint code expects a
``state_dict`` entry our checkpoints do not have. This subclass keeps
MMEngine's averaging (the same ``ExponentialMovingAverage`` & co. models,
``begin_iter`` / ``begin_epoch``, ``strict_load``) but:

* builds the averaged model from an fp32 copy of the model taken before
  DeepSpeed partitions it (the runner hands it over);
* reads the source weights gathered (ZeRO-3) and in fp32;
* for validation and test, exchanges the EMA weights and the engine module's
  (as MMEngine does) and restores both exactly afterwards (``GatheredParameters``
  with a modifier rank under ZeRO-3), leaving DeepSpeed's fp32 masters untouched;
* saves and resumes ``ema_state_dict`` in our client state, which
  ``mmengine-deepspeed convert --ema`` exports.

DeepSpeedRunner uses it wherever a config asks for ``EMAHook``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
from mmengine.hooks import EMAHook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS, MODELS
from torch import nn
from typing_extensions import override

from ..checkpoint.layout import EMA_KEY
from ..compat import ema_started
from ..strategy import strategy_of
from ..zero.gather import gathered, whole_copy


class _Fp32View:
    """What ``BaseAveragedModel.update_parameters`` reads, as fp32 tensors."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float() for k, v in self.module.state_dict().items()}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((k, v.detach().float()) for k, v in self.module.named_parameters())

    def buffers(self) -> Iterator[torch.Tensor]:
        return (b.detach() for b in self.module.buffers())


@HOOKS.register_module()
class DeepSpeedEMAHook(EMAHook):
    """:class:`mmengine.hooks.EMAHook` for models inside a DeepSpeed engine.

    Args:
        **kwargs: The arguments of :class:`mmengine.hooks.EMAHook`.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._template: Optional[nn.Module] = None
        self._trained: Optional[dict[str, torch.Tensor]] = None
        self._averaged: Optional[dict[str, torch.Tensor]] = None
        self._steps: Optional[int] = None  # the averaged model's step count, as a number

    def before_partitioning(self, runner: Any, model: nn.Module) -> None:
        """Keep an fp32 copy of the bare model: DeepSpeedRunner's hook event between
        the optimizers and ``deepspeed.initialize``.

        A model built partitioned (``zero.Init``) is gathered for the copy,
        whose parameters are plain: the averaged model is whole on every rank.
        """
        self._template = whole_copy(model).float()

    @override
    def before_run(self, runner: Any) -> None:
        """Build the averaged model from the fp32 template.

        Driven by hand before ``train()`` / ``val()`` / ``test()`` built the
        engines (as MMEngine's tests and some user hooks drive hooks), it
        copies the model as it is now, gathered under ZeRO-3.
        """
        template, self._template = self._template, None
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        if template is None:
            template = whole_copy(model).float()
        self.src_model = model
        self.ema_model = MODELS.build(self.ema_cfg, default_args=dict(model=template))
        self._steps = None

    @override
    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        """Average the gathered fp32 weights (or copy them before EMA starts); gathered
        only on the iterations that blend them."""
        if not ema_started(self, runner):
            self._copy_model()
            return
        ema = self.ema_model
        steps = int(ema.steps) if self._steps is None else self._steps  # read once per load
        blends = steps == 0 or steps % ema.interval == 0
        with gathered(self.src_model) if blends else contextlib.nullcontext():
            self._update_averaged(_Fp32View(self.src_model), steps, blends)
        self._steps = steps + 1

    def _update_averaged(self, source: _Fp32View, steps: int, blends: bool) -> None:
        """MMEngine's ``BaseAveragedModel.update_parameters``, with its step count kept
        here as a number too: MMEngine's reads the count's tensor on the host twice per
        iteration (a device wait on a GPU). The same arithmetic, pinned against MMEngine's
        by tests/unit/test_hooks_ema.py."""
        ema = self.ema_model
        if blends:
            sources = (source.state_dict() if ema.update_buffers
                       else dict(source.named_parameters()))
            for key, averaged in ema.avg_parameters.items():
                if steps == 0:
                    averaged.data.copy_(sources[key].data)
                elif averaged.dtype.is_floating_point:
                    ema.avg_func(averaged.data, sources[key].data.to(averaged.device), steps)
        if not ema.update_buffers:  # buffers follow the model's (never partitioned)
            for mine, theirs in zip(ema.module.buffers(), source.buffers()):
                mine.data.copy_(theirs.data.to(mine.device))
        ema.steps += 1

    @override
    def _swap_ema_parameters(self) -> None:
        """Exchange the EMA weights and the model's, as MMEngine does, exactly both ways.

        MMEngine swaps in place: during validation the model holds the averaged
        weights and the averaged model the trained ones. Here both are also kept
        aside, each in its own dtype, and the swap back restores them from there:
        an fp32 average that spent the validation in a bf16 model, or bf16 weights
        that spent it in the fp32 averaged model, come back bit for bit.
        """
        names = [name for name, _ in self._averaged_items()]
        with gathered(self.src_model, modify=True):
            live = dict(self._live_items())
            averaged = dict(self._averaged_items())
            if self._trained is None:
                self._trained = {n: live[n].detach().clone() for n in names}
                self._averaged = {n: averaged[n].detach().clone() for n in names}
                for name in names:
                    live[name].data.copy_(self._averaged[name])
                    averaged[name].data.copy_(self._trained[name])
            else:
                trained, kept = self._trained, self._averaged or {}
                for name in names:
                    live[name].data.copy_(trained[name])
                    averaged[name].data.copy_(kept[name])
                self._trained = self._averaged = None

    def _averaged_items(self) -> list[tuple[str, torch.Tensor]]:
        module = self.ema_model.module
        items = list(module.named_parameters())
        if self.ema_model.update_buffers:
            items += list(module.named_buffers())
        return items

    def _live_items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.src_model.named_parameters()) + list(self.src_model.named_buffers())

    @override
    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        """Save the averaged model (full fp32 weights, ``module.``-prefixed keys)."""
        checkpoint[EMA_KEY] = self.ema_model.state_dict()

    @override
    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        """Resume the averaged model; ``load_from`` weights are in the template already."""
        if not strategy_of(runner, 'EMAHook').checkpointer.resuming:
            return
        if EMA_KEY in checkpoint:
            self.ema_model.load_state_dict(checkpoint[EMA_KEY], strict=self.strict_load)
            self._steps = None  # read again from the loaded count
            return
        runner.logger.warning('The checkpoint has no ema_state_dict; EMAHook starts from the '
                              'resumed weights.')
        self._copy_model()

    def _copy_model(self) -> None:
        """Set the averaged model to the model's gathered fp32 weights and buffers."""
        with gathered(self.src_model):
            current = _Fp32View(self.src_model).state_dict()
            for key, value in self.ema_model.module.state_dict().items():
                value.data.copy_(current[key])
