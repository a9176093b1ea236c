"""Register DeepSpeed's optimizers in MMEngine's ``OPTIMIZERS`` registry.

ZeRO-Offload needs ``DeepSpeedCPUAdam`` (or ``DeepSpeedCPUAdagrad`` /
``DeepSpeedCPULion``) and CUDA runs want ``FusedAdam``; a config names them as
``optim_wrapper.optimizer.type``. MMEngine's own registration
(``mmengine._strategy.deepspeed.register_deepspeed_optimizers``) imports
``deepspeed.runtime.fp16.onebit``, which DeepSpeed 0.19 removed, so it fails
before registering anything; this one imports only the public ``deepspeed.ops``
modules.
"""
from __future__ import annotations

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lamb import FusedLamb
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from mmengine.registry import OPTIMIZERS

DEEPSPEED_OPTIMIZERS = (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedAdam,
                        FusedLamb, FusedLion)


def register_deepspeed_optimizers() -> list[str]:
    """Register DeepSpeed's optimizers; safe to call more than once.

    Returns:
        list[str]: The names now available as ``optimizer.type``.
    """
    names = []
    for cls in DEEPSPEED_OPTIMIZERS:
        if OPTIMIZERS.get(cls.__name__) is None:
            OPTIMIZERS.register_module(module=cls)
        names.append(cls.__name__)
    return names
