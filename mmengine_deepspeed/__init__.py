"""Train OpenMMLab MMEngine models with DeepSpeed.

Importing this package registers ``DeepSpeedRunner`` (``RUNNERS``),
``DeepSpeedOptimWrapper`` (``OPTIM_WRAPPERS``), ``DeepSpeedEngineWrapper``
(``MODEL_WRAPPERS``) and DeepSpeed's optimizers (``OPTIMIZERS``), so a config
needs only ``custom_imports``, ``runner_type`` and ``ds_config``.

It never imports MMEngine's ``DeepSpeedStrategy`` machinery, whose optimizer
registration imports a module DeepSpeed 0.19 removed.
"""
from .checkpoint import CheckpointError, export_checkpoint
from .config import DsConfigError, MMEngineSide, resolve_ds_config
from .dist import init_distributed
from .engine import DeepSpeedEngineWrapper
from .optim_wrapper import DeepSpeedOptimWrapper
from .optimizers import register_deepspeed_optimizers
from .runner import DeepSpeedRunner
from .version import __version__

register_deepspeed_optimizers()

__all__ = [
    'CheckpointError',
    'DeepSpeedEngineWrapper',
    'DeepSpeedOptimWrapper',
    'DeepSpeedRunner',
    'DsConfigError',
    'MMEngineSide',
    '__version__',
    'export_checkpoint',
    'init_distributed',
    'register_deepspeed_optimizers',
    'resolve_ds_config',
]
