"""ZeRO-Offload with the optimizer from ``optim_wrapper``: DeepSpeed's CPU Adam in its place.

With ``zero_optimization.offload_optimizer.device`` 'cpu' or 'nvme' the
optimizer steps on the CPU, and DeepSpeed 0.19 refuses any client optimizer
but its own CPU ones unless ``zero_force_ds_cpu_optimizer`` is false. A
torch Adam/AdamW built by MMEngine (``paramwise_cfg``, ``auto_scale_lr`` and
custom constructors applied, param groups and all) is rebuilt as
``DeepSpeedCPUAdam`` over the same groups with the same hyper-parameters,
so param schedulers drive it as they would have driven the torch one.
NVMe offload needs DeepSpeed's async I/O op, which builds only with libaio:
that is checked when the runner is created, not after the model is built.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer

from ..config.checks import offload_devices
from ..config.resolve import zero_stage

CPU_OPTIMIZER_HINT = (
    "use optimizer=dict(type='DeepSpeedCPUAdam', ...) (or DeepSpeedCPUAdagrad / "
    'DeepSpeedCPULion, from deepspeed.ops), or set "zero_force_ds_cpu_optimizer": false in '
    'ds_config to step this optimizer on the CPU as it is (slower)')


def check_nvme(ds_config: dict) -> None:
    """Refuse NVMe offload where DeepSpeed's async I/O op cannot build.

    Raises:
        RuntimeError: Naming what to install, before anything is built.
    """
    if 'nvme' not in offload_devices(ds_config) or zero_stage(ds_config) == 0:
        return
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder('AsyncIOBuilder')
    if builder is None or not builder.is_compatible():
        raise RuntimeError(
            'ds_config offloads to "nvme", which needs DeepSpeed\'s async_io op, and it cannot '
            'build here: install libaio (apt install libaio-dev, yum install libaio-devel, or '
            'conda install -c conda-forge libaio; set CFLAGS/LDFLAGS if it lives elsewhere), or '
            'offload to "cpu" instead.')


def cpu_optimizer(optimizer: Optimizer, ds_config: dict) -> tuple[Optimizer, Optional[str]]:
    """The optimizer DeepSpeed accepts for ``ds_config``'s offload, and a log line if swapped.

    Args:
        optimizer (Optimizer): Built by MMEngine from ``optim_wrapper``.
        ds_config (dict): The engine's resolved ds_config.

    Returns:
        tuple[Optimizer, str | None]: ``optimizer`` itself when nothing is
        offloaded, it is already a DeepSpeed CPU optimizer or the user
        turned the check off; otherwise a ``DeepSpeedCPUAdam`` over the
        same param groups and the line saying so.

    Raises:
        ValueError: For an optimizer DeepSpeed's CPU Adam cannot stand in
            for (SGD, LAMB, AMSGrad...), naming the choices.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion
    if offload_devices(ds_config)[0] is None or zero_stage(ds_config) == 0 \
            or not ds_config.get('zero_force_ds_cpu_optimizer', True) \
            or isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
        return optimizer, None
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or any(
            g.get('amsgrad') or g.get('maximize') for g in groups):
        raise ValueError(
            f'ds_config offloads the optimizer (zero_optimization.offload_optimizer), and '
            f'DeepSpeed steps only its own CPU optimizers there; {name} from optim_wrapper has '
            f'no DeepSpeed equivalent (torch Adam/AdamW without amsgrad/maximize are swapped for '
            f'DeepSpeedCPUAdam automatically): {CPU_OPTIMIZER_HINT}.')
    defaults = optimizer.defaults
    decoupled = bool(defaults.get('decoupled_weight_decay',
                                  isinstance(optimizer, torch.optim.AdamW)))
    swapped = DeepSpeedCPUAdam(
        [dict(group) for group in groups], lr=defaults['lr'], betas=defaults['betas'],
        eps=defaults['eps'], weight_decay=defaults['weight_decay'],
        adamw_mode=decoupled)
    return swapped, (f'Optimizer offload: {name} from optim_wrapper is stepped by '
                     f'DeepSpeedCPUAdam (adamw_mode={decoupled}) '
                     f'with the same {len(groups)} param group(s) and hyper-parameters.')
