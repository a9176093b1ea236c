"""Models built partitioned under ZeRO-3, and initialised one parameter group at a time.

Under ZeRO-3 the runner builds a model from its config inside
``deepspeed.zero.Init``: each submodule's parameters are partitioned as soon
as its ``__init__`` returns, so no rank ever holds the whole model. What
comes after construction must then see whole tensors again without
gathering the whole model:

* a parent module's ``__init__`` touching a child's parameters after the
  child's ``__init__`` returned (MMCV's ``ConvModule`` initialises its conv
  there, in MMDetection's necks and heads and MMSegmentation's decoders;
  ``self.apply(init_fn)``; ``self.fc.bias.data.zero_()``), ``init_weights()``
  / ``init_cfg`` (MMEngine's initialisers, a model's own ``init_weights``
  calling ``nn.init.normal_(self.head.weight)``, or
  ``m.weight.data.normal_()``) and ``load_from`` run inside
  :class:`~.gather.GatherOnUse`: a torch function mode in which any torch operation
  on a partitioned parameter first gathers that parameter. Gathered
  parameters stay whole until more than the largest submodule's worth is
  gathered; the oldest are then given back, rank 0's values broadcast
  (every rank ends with rank 0's initialisation, as DeepSpeed does at
  construction) and re-partitioned. Same operations on the same whole
  tensors in the same order means the same random numbers: the result is
  the tensors the model gets without ``zero.Init``. (DeepSpeed itself
  gathers only for ``Module.apply``: a ``ConvModule``'s own initialisation
  then drew no random numbers on the empty partition, and every later draw
  of the model differed from MMEngine's ``Runner``'s.)
* 0-dim parameters: DeepSpeed broadcasts a parameter as bytes
  (``view(torch.uint8)``), which torch refuses for a 0-dim tensor. They are
  partitioned as 1-element, 1-dim tensors and recorded 0-dim afterwards,
  as ``zero_dim.py`` does for ``deepspeed.initialize``.

Model code does more with tensors in ``__init__`` than DeepSpeed's
constructor overrides expect, so :class:`PartitionedInit` changes two of them:

* ``torch.Tensor(data)``: DeepSpeed replaces ``torch.Tensor.__new__`` with
  ``new_empty(*args)``, which reads every argument as a size: a numpy array
  or a list of floats raises (MMDetection's ``AnchorGenerator``), and a list
  of ints silently becomes an uninitialised tensor of that shape. Data goes
  to torch's own constructor (:func:`legacy_constructor`).
* dtype: DeepSpeed casts every floating tensor made inside the block to the
  training dtype, positional encodings, anchors and other plain tensors
  included, which a model built whole keeps in fp32. Only device placement
  is overridden here; parameters are cast as they are partitioned, so they
  hold the same values as a model built whole and cast by the engine.

Where construction still fails, the runner builds the model whole instead
(:func:`construction_failure` names the call for its log line).
"""
from __future__ import annotations

import copy
import ctypes
import ctypes.util
import os.path as osp
import traceback
from collections.abc import Callable
from typing import Any, Optional

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride
from mmengine import dist as mmengine_dist
from torch import nn
from typing_extensions import override

from ..compat import full_numel, set_full_shape
from .gather import GatherOnUse
from .zero_dim import SCALAR_SHAPE


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None


MALLOC_TRIM = _malloc_trim()


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc), so RSS shows live tensors.

    Building partitioned frees each parameter's whole tensor right after
    keeping this rank's part; glibc keeps such freed blocks mapped (they are
    below its adaptive mmap threshold after the first one), and the parts
    allocated between them stop the heap from shrinking. Measured on 2 ranks
    with 64 layers of 1 MiB: peak RSS rise 0.9x the fp32 model without this,
    the 0.5x of the partitions with it.
    """
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


def _is_size(args: tuple) -> bool:
    """Whether ``torch.Tensor(*args)`` asks for a shape (ints, or one torch.Size)."""
    if len(args) == 1 and isinstance(args[0], torch.Size):
        return True
    return all(isinstance(a, int) and not isinstance(a, bool) for a in args)


def legacy_constructor(plain: Callable[..., torch.Tensor],
                       sized: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.Tensor.__new__`` that gives data to torch and sizes to DeepSpeed.

    Args:
        plain (Callable): torch's own ``torch.Tensor.__new__``.
        sized (Callable): DeepSpeed's replacement, which places a tensor of a
            given shape on the device ``zero.Init`` builds on.

    Returns:
        Callable: What ``torch.Tensor(...)`` then calls: ``torch.Tensor(2, 3)``
        and ``torch.Tensor(torch.Size([2]))`` as DeepSpeed does,
        ``torch.Tensor(array)``, ``torch.Tensor([8, 16])`` and
        ``torch.Tensor(tensor)`` as torch does, on DeepSpeed's device.
    """
    def new(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_size(args):
            return sized(cls, *args, **kwargs)
        made = plain(cls, *args, **kwargs)
        return made if 'device' in kwargs else made.to(sized(cls).device)
    return new


class PartitionedInit(deepspeed.zero.Init):
    """``deepspeed.zero.Init`` for real model code: 0-dim parameters, ``torch.Tensor(data)``,
    and plain tensors in the dtype torch gives them (see the module docstring).

    DeepSpeed 0.19's ``Init._zero_init_param`` (private; overridden because
    it is where every new parameter is broadcast and partitioned) sends the
    parameter as ``data.view(torch.uint8)``, impossible for a 0-dim tensor.
    Here such a parameter is 1-dim for that call; its recorded full shape
    (``ds_shape``) is then made 0-dim, which every gather restores. A
    floating parameter is cast to the training dtype (DeepSpeed's ``dtype``
    attribute, set from the ds_config) first. tests/dist/test_partitioned.py
    builds models with each.
    """

    def __init__(self, config_dict_or_path: dict):
        # GatherOnUse gathers what a function given to Module.apply touches, as it does
        # everywhere else in the block: DeepSpeed's own apply wrapper (which gathers
        # and re-partitions every parameter of each module) is switched off
        config = copy.deepcopy(config_dict_or_path)
        config.setdefault('zero_optimization', {})['override_module_apply'] = False
        super().__init__(config_dict_or_path=config,
                         tensor_overrides=[DeepSpeedTensorOverride.device])
        self._deepspeed_new: Optional[Callable[..., torch.Tensor]] = None

    # The gathering of the block being built in, one per process (the outermost block's).
    # Class-wide: DeepSpeed may call an earlier block's _post_init_method (its skip_init
    # hooks stay on the module classes when a module built on the meta device is never
    # given to to_empty), and that partitioning must go by this block's gathering too.
    _constructing: Optional[GatherOnUse] = None

    @override
    def __enter__(self) -> None:
        plain = torch.Tensor.__new__
        super().__enter__()
        if torch.Tensor.__new__ is not plain:  # the outermost block patched it
            self._deepspeed_new = torch.Tensor.__new__
            torch.Tensor.__new__ = legacy_constructor(  # type: ignore[method-assign,assignment]
                plain, self._deepspeed_new)
            # the budget grows with the modules built (see _post_init_method)
            PartitionedInit._constructing = GatherOnUse(budget=0)
            PartitionedInit._constructing.__enter__()

    @override
    def _post_init_method(self, module: nn.Module) -> None:
        gather = PartitionedInit._constructing
        if gather is None:
            super()._post_init_method(module)
            return
        with gather.paused():  # DeepSpeed partitioning the module's new parameters
            super()._post_init_method(module)
        gather.budget = max(gather.budget, sum(
            full_numel(p) for p in module.parameters(recurse=False)))

    @override
    def __exit__(self, *exc: Any) -> Any:
        if self._deepspeed_new is not None:  # the outermost block
            gather, PartitionedInit._constructing = PartitionedInit._constructing, None
            if gather is not None:
                gather.__exit__(*exc)  # collective: every rank gives back what it gathered
            torch.Tensor.__new__ = self._deepspeed_new  # type: ignore[method-assign,assignment]
            self._deepspeed_new = None
        return super().__exit__(*exc)

    def _zero_init_param(self, param: nn.Parameter) -> None:
        if param.is_floating_point() and param.dtype != self.dtype:
            param.data = param.data.to(self.dtype)
        if param.shape != SCALAR_SHAPE:
            super()._zero_init_param(param)
        else:
            param.data = param.data.reshape(1)
            super()._zero_init_param(param)
            set_full_shape(param, SCALAR_SHAPE)
            if param.data.numel() == 1:  # a persistent (small) parameter stays whole
                param.data = param.data.view(SCALAR_SHAPE)
        if param.device.type == 'cpu':
            return_freed_memory()


def partitioned_construction(ds_config: dict) -> PartitionedInit:
    """The block a model is built in to be partitioned as it is built.

    DeepSpeed's communication layer is brought up on the runner's process
    group first (``deepspeed.initialize`` would do it only later), so the
    config's batch sizes are checked against the real world size.
    """
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    return PartitionedInit(config_dict_or_path=ds_config)


# torch's files; with DeepSpeed's and this package's, no model code (a failure passes through
# all three)
TORCH_CODE = osp.dirname(torch.__file__ or '') + osp.sep
NOT_MODEL_CODE = (TORCH_CODE, osp.dirname(deepspeed.__file__ or '') + osp.sep,
                  osp.dirname(osp.dirname(osp.abspath(__file__))) + osp.sep)


def model_frame(error: BaseException) -> str:
    """Where in model code ``error`` came from: the innermost frame outside torch,
    DeepSpeed and this package, as ``file:line `code```."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(NOT_MODEL_CODE)]
    return (f'{frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`'
            if frames else 'an unknown call')


def construction_failure(error: BaseException) -> str:
    """The model code's call an error came from, and the error (one line): the line of the
    model (or library) that did what ``zero.Init``, the meta device or ``plan`` could not."""
    return f'{model_frame(error)}: {type(error).__name__}: {error}'


def agreed_everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce; construction only)."""
    flag = torch.tensor([0 if ok else 1])
    mmengine_dist.all_reduce(flag)  # on the backend's device (nccl: CUDA)
    return int(flag.item()) == 0


def built_partitioned(build: Callable[[], nn.Module], build_whole: Callable[[], nn.Module],
                      zero_config: dict, logger: Any) -> nn.Module:
    """``build()`` inside ``zero.Init``; where model code cannot run there, ``build_whole()``.

    Every rank agrees (one all-reduce, at construction only), so the ranks build
    the same way; the fallback logs the call that failed and the memory it costs.

    Args:
        build (Callable): Builds the model (MMEngine's ``build_model``).
        build_whole (Callable): Builds it again outside ``zero.Init``, drawing
            what a model built whole from the start draws.
        zero_config (dict): The resolved ds_config the block is built with
            (:func:`partitioned_construction`).
        logger (Any): The runner's logger.

    Returns:
        nn.Module: The model, partitioned, or whole where zero.Init failed on any rank.
    """
    built: Optional[nn.Module] = None
    failure: Optional[str] = None
    try:
        with partitioned_construction(zero_config):
            built = build()
    except Exception as error:  # model code zero.Init cannot build: whole, below
        failure = construction_failure(error)
    if agreed_everywhere(built is not None) and built is not None:
        logger.info('Built the model partitioned under ZeRO-3 (deepspeed.zero.Init); '
                    'set zero_init=False to build it whole on every rank.')
        return built
    whole = build_whole()
    logger.warning(whole_construction_note(failure, whole))
    return whole


def whole_construction_note(failure: Optional[str], model: nn.Module) -> str:
    """The log line for a ZeRO-3 model built whole: why, and what it costs per rank."""
    mib = sum(t.numel() * t.element_size()
              for t in (*model.parameters(), *model.buffers())) / 2**20
    why = f'zero.Init could not build the model ({failure})' if failure is not None else \
        'zero.Init could not build the model on another rank'
    return (f'{why}; built it whole on every rank instead ({mib:.1f} MiB per rank until '
            'DeepSpeed partitions it). Change that call to build under zero.Init, or set '
            'zero_init=False to skip the attempt.')


def build_advice(model: Any, stage: int, zero_init: bool, several: bool) -> Optional[str]:
    """Why a ZeRO-3 model is built whole on every rank, with what to do instead.

    Args:
        model (nn.Module | dict): The runner's ``model`` argument.
        stage (int): The ZeRO stage.
        zero_init (bool): The runner's ``zero_init`` switch.
        several (bool): The model gets several engines (one per optimizer).

    Returns:
        str | None: The line to log, or None when the model is built
        partitioned (or ZeRO-3 is not used, or the user turned it off).
    """
    if not zero_init or stage != 3:
        return None
    if isinstance(model, nn.Module):
        return ('The model was passed built, so every rank held it whole before ZeRO-3 '
                'partitioned it; pass its config instead (model=dict(type=...)) and '
                'DeepSpeedRunner builds it partitioned (deepspeed.zero.Init).')
    if several:
        return ('Several optimizers: the model is built whole on every rank and each engine '
                'partitions its own submodule (deepspeed.zero.Init builds for one engine).')
    return None
