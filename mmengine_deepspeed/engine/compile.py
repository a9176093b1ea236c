"""MMEngine's ``compile`` key, honoured the way DeepSpeed supports: each engine's module.

MMEngine's Runner applies ``torch.compile`` to ``model.train_step``; under
DeepSpeed that drags the engine's hooks, bookkeeping and collectives into
dynamo's graph (ZeRO-2 dies building guards, ZeRO-3 recompiles until dynamo
gives up). DeepSpeed's ``engine.compile()`` compiles the module inside the
engine instead (``nn.Module.compile``), so the forward (and, through
AOTAutograd, its backward) is compiled and the engine stays eager around it
(under ZeRO-3 DeepSpeed's per-module hooks run eagerly between the compiled
pieces, see :func:`hooks_run_eagerly`).
A model with several engines has each optimizer's submodule compiled, which
is what its own ``train_step`` calls.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.compile import util as deepcompile_util

from ..compat import dynamo_counts, hook_dict_of, zero3_module_hooks
from ..config.checks import DsConfigError, get_value
from .spec import EngineSpecs

CompileCfg = Union[bool, dict, None]


def compile_options(compile_cfg: CompileCfg) -> Optional[dict]:
    """``torch.compile`` options from MMEngine's ``compile`` key; None: do not compile.

    Raises:
        TypeError: ``compile`` is neither a bool nor a dict.
    """
    if compile_cfg is None or compile_cfg is False:
        return None
    if compile_cfg is True:
        return {}
    if not isinstance(compile_cfg, dict):
        raise TypeError(
            f'compile={compile_cfg!r}: give True, or the options of torch.compile as a dict, '
            "e.g. compile=dict(backend='inductor', mode='max-autotune').")
    return dict(compile_cfg)


def check_deepcompile(options: Optional[dict], ds_configs: Iterable[Mapping[str, Any]]) -> None:
    """Refuse ``ds_config.compile.deepcompile`` where it cannot take effect, before any
    process work.

    DeepCompile (DeepSpeed's compiler, which puts ZeRO's gathers and reductions into the
    compiled graph instead of running its per-module hooks between compiled pieces) runs
    only inside ``engine.compile()``: without MMEngine's ``compile`` key it would be
    ignored without a word. DeepSpeed 0.19 builds it for CUDA and torch >= 2.6 only;
    elsewhere ``engine.compile()`` fails compiling CUDA sources (``cuda.h: No such file``).

    Args:
        options (dict, optional): :func:`compile_options` of the config; None: no compile.
        ds_configs (Iterable[Mapping]): Every engine's ds_config.

    Raises:
        DsConfigError: DeepCompile asked for without ``compile``, or where it cannot run.
    """
    if not any(get_value(ds, 'compile.deepcompile') for ds in ds_configs):
        return
    if options is None:
        raise DsConfigError(
            'ds_config.compile.deepcompile is true, but nothing is compiled without '
            "MMEngine's compile key: add compile=True to the config (DeepSpeed then compiles "
            'each engine with DeepCompile), or remove compile.deepcompile.')
    if not deepcompile_util.is_deepcompile_supported():
        raise DsConfigError(
            'ds_config.compile.deepcompile is true, but DeepSpeed builds DeepCompile for CUDA '
            f'with torch >= 2.6 only (here: {get_accelerator().device_name()}, torch '
            f'{torch.__version__}): remove compile.deepcompile; compile=True alone compiles '
            'each engine with torch.compile.')


def compile_engines(specs: EngineSpecs, options: dict, logger: Any) -> dict[str, int]:
    """Compile every engine's module with ``options`` (``backend`` and torch.compile's kwargs).

    Compilation itself happens on the first forward of each mode (loss,
    predict); the returned counts let the caller report what it cost.

    Returns:
        dict[str, int]: dynamo's counts before compiling (see
        :func:`compile_report`).
    """
    options = dict(options)
    backend = options.pop('backend', 'inductor')
    for spec in specs:
        assert spec.engine is not None, 'compile_engines runs after the engines are built'
        hooks_run_eagerly(spec.engine)
        spec.engine.compile(backend=backend, compile_kwargs=options)
    names = ', '.join(f'model.{s.path}' if s.path else 'the model' for s in specs)
    logger.info(f'torch.compile (backend={backend!r}{", " if options else ""}'
                f'{", ".join(f"{k}={v!r}" for k, v in options.items())}) applied to {names} '
                "inside the DeepSpeed engine (engine.compile()), not to train_step; the first "
                'iterations of training and of validation compile.')
    return dynamo_counts()


def hooks_run_eagerly(engine: Any) -> int:
    """Make dynamo run a ZeRO-3 engine's per-module hooks as they are, untraced.

    DeepSpeed marks its pre-forward hook so, not its post-forward and
    pre-backward hooks: dynamo traced those into every submodule's call,
    with guards on the module, and compiled them again for each module type
    until its recompile limit ("torch._dynamo hit config.recompile_limit"),
    then ran them eagerly anyway. Untraced from the start, they cost no
    compilation and no warning, and the graphs between them are the same.

    Returns:
        int: How many hooks were marked (0 below ZeRO-3).
    """
    marked = 0
    for handle in zero3_module_hooks(engine):
        hooks = hook_dict_of(handle)
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = torch.compiler.disable(hooks[handle.id])
            marked += 1
    return marked


def compile_report(before: dict[str, int]) -> str:
    """What dynamo built since ``before``: graphs, graph breaks, frames looked at.

    A graph built again for new inputs (a recompilation) counts again, so a
    count that grows with the number of iterations means a recompilation storm.
    Code compiled by an earlier runner in this process is reused (dynamo guards
    on inputs, not on the module instance), so a later runner may build none.
    """
    now = dynamo_counts()
    frames, graphs, breaks = (now[k] - before.get(k, 0)
                              for k in ('frames', 'graphs', 'graph_breaks'))
    if frames == 0:
        return ('torch.compile built no new graph during this run: the compiled code of an '
                'earlier runner in this process served it.')
    return (f'torch.compile built {graphs} graphs ({breaks} graph breaks, {frames} frames '
            'looked at) during this run.')
