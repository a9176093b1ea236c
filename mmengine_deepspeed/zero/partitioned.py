"""Models built partitioned under ZeRO-3, and initialised one parameter group at a time.

Under ZeRO-3 the runner builds a model from its config inside
``deepspeed.zero.Init``: each submodule's parameters are partitioned as soon
as its ``__init__`` returns, so no rank ever holds the whole model. What
comes after construction must then see whole tensors again without
gathering the whole model:

* ``init_weights()`` / ``init_cfg`` (MMEngine's initialisers, a model's own
  ``init_weights`` calling ``nn.init.normal_(self.head.weight)``, or
  ``m.weight.data.normal_()``) and ``load_from`` run inside
  :class:`GatherOnUse`: a torch function mode in which any torch operation
  on a partitioned parameter first gathers that parameter. Gathered
  parameters stay whole until more than the largest submodule's worth is
  gathered; the oldest are then given back, rank 0's values broadcast
  (every rank ends with rank 0's initialisation, as DeepSpeed does at
  construction) and re-partitioned. Same operations on the same whole
  tensors in the same order means the same random numbers: the result is
  the tensors the model gets without ``zero.Init``.
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

Where construction still fails (code reading a just-partitioned parameter's
values, say), the runner builds the model whole instead
(:func:`construction_failure` names the call for its log line).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os.path as osp
import traceback
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride
from mmengine import dist as mmengine_dist
from torch import nn
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from ..compat import full_numel, full_shape, is_released, is_zero3_param, set_full_shape
from ..config.model_settings import largest_layer
from .zero_dim import SCALAR_SHAPE, broadcastable


def is_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s parameters were built by ``zero.Init`` (ZeRO-3 parameters)."""
    return any(is_zero3_param(p) for p in model.parameters())


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
        super().__init__(config_dict_or_path=config_dict_or_path,
                         tensor_overrides=[DeepSpeedTensorOverride.device])
        self._deepspeed_new: Optional[Callable[..., torch.Tensor]] = None

    @override
    def __enter__(self) -> None:
        plain = torch.Tensor.__new__
        super().__enter__()
        if torch.Tensor.__new__ is not plain:  # the outermost block patched it
            self._deepspeed_new = torch.Tensor.__new__
            torch.Tensor.__new__ = legacy_constructor(  # type: ignore[method-assign,assignment]
                plain, self._deepspeed_new)

    @override
    def __exit__(self, *exc: Any) -> Any:
        if self._deepspeed_new is not None:
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


_NOT_MODEL_CODE = tuple(osp.dirname(module.__file__ or '') + osp.sep
                        for module in (torch, deepspeed))


def construction_failure(error: BaseException) -> str:
    """The model code's call an error came from, and the error (one line).

    The innermost frame outside torch and DeepSpeed: the line of the model (or
    library) that did what ``zero.Init``, the meta device or ``plan`` could not.
    """
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(_NOT_MODEL_CODE)]
    where = (f'{frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`'
             if frames else 'an unknown call')
    return f'{where}: {type(error).__name__}: {error}'


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


def _zero_params(value: Any, found: dict[int, nn.Parameter]) -> None:
    if isinstance(value, nn.Parameter):
        if is_zero3_param(value):
            found.setdefault(id(value), value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _zero_params(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _zero_params(item, found)


def _getters(*names: str) -> frozenset:
    return frozenset(getattr(torch.Tensor, name).__get__ for name in names)


# What a tensor's shape answers: for a partitioned parameter, answered from
# its full shape without gathering (MMEngine logs shapes on rank 0 only, and
# a gather there would wait for ranks that never come).
SHAPE_QUERIES = _getters('shape', 'ndim') | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement}
# What the partitioned parameter itself answers as well as the whole one.
PARAMETER_QUERIES = _getters('dtype', 'device', 'requires_grad', 'is_leaf', 'grad') | {
    torch.Tensor.requires_grad_}


class GatherOnUse(TorchFunctionMode):
    """Inside the block, ZeRO-3 parameters are whole wherever torch touches them.

    Every rank must run the same operations on the same parameters in the
    same order (gathering is collective), which initialisation and loading
    do. Persistent (small, never partitioned) ZeRO-3 parameters are taken
    too, so every rank ends with rank 0's values for them as well.

    Args:
        model (nn.Module): The partitioned model; its largest submodule
            sets how many elements may be gathered at once.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self._budget = largest_layer(model)
        self._held: OrderedDict[int, tuple[nn.Parameter, Any]] = OrderedDict()
        self._numel = 0
        self.peak_numel = 0

    @override
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in PARAMETER_QUERIES:
            return func(*args, **kwargs)
        if func in SHAPE_QUERIES and args and is_released(args[0]):
            whole = torch.empty(full_shape(args[0]), device='meta')
            return func(whole, *args[1:], **kwargs)
        found: dict[int, nn.Parameter] = {}
        _zero_params(args, found)
        _zero_params(kwargs, found)
        for param in found.values():
            self._take(param)
        return func(*args, **kwargs)

    def _take(self, param: nn.Parameter) -> None:
        key = id(param)
        if key in self._held:
            self._held.move_to_end(key)
            return
        numel = full_numel(param)
        while self._held and self._numel + numel > self._budget:
            self._give_back(next(iter(self._held)))
        gathered = deepspeed.zero.GatheredParameters([param], modifier_rank=0)
        gathered.__enter__()
        self._held[key] = (param, gathered)
        self._numel += numel
        self.peak_numel = max(self.peak_numel, self._numel)

    def _give_back(self, key: int) -> None:
        param, gathered = self._held.pop(key)
        self._numel -= full_numel(param)
        # Leaving GatheredParameters broadcasts rank 0's values as bytes:
        # a whole 0-dim parameter is 1-dim just for that (zero_dim.py).
        with broadcastable([param]):
            gathered.__exit__(None, None, None)

    @override
    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        while self._held:
            self._give_back(next(iter(self._held)))


def gather_on_use(model: nn.Module) -> AbstractContextManager:
    """:class:`GatherOnUse` for a partitioned ``model``, else a block that does nothing."""
    return GatherOnUse(model) if is_partitioned(model) else nullcontext()


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
