"""Train OpenMMLab MMEngine models with DeepSpeed.

Importing this package registers ``DeepSpeedRunner`` (``RUNNERS``),
``DeepSpeedOptimWrapper`` (``OPTIM_WRAPPERS``), ``DeepSpeedEngineWrapper``
(``MODEL_WRAPPERS``) and DeepSpeed's optimizers (``OPTIMIZERS``), so a config
needs only ``custom_imports``, ``runner_type`` and ``ds_config``; a ``tools/train.py``
that calls ``Runner.from_cfg(cfg)`` whatever the config says (MMagic's) gets the
runner the config names too.

It never imports MMEngine's ``DeepSpeedStrategy`` machinery, whose optimizer
registration imports a module DeepSpeed 0.19 removed.
"""
from .ops import keep_builds_per_install
from .quiet import hide_cpu_accelerator_notice

hide_cpu_accelerator_notice()  # before the imports below import DeepSpeed
keep_builds_per_install()

from .checkpoint import CheckpointError, export_checkpoint  # noqa: E402
from .compat import check_upstream, route_from_cfg_to  # noqa: E402
from .config.resolve import DsConfigError, MMEngineSettings, resolve_ds_config  # noqa: E402
from .dist import init_distributed  # noqa: E402
from .engine.optim_wrapper import DeepSpeedOptimWrapper  # noqa: E402
from .engine.optimizers import register_deepspeed_optimizers  # noqa: E402
from .engine.wrapper import DeepSpeedEngineWrapper  # noqa: E402
from .runner import DeepSpeedRunner  # noqa: E402
from .version import __version__  # noqa: E402

register_deepspeed_optimizers()
route_from_cfg_to(DeepSpeedRunner)  # MMagic's tools/train.py calls Runner.from_cfg
check_upstream()

__all__ = [
    'CheckpointError',
    'DeepSpeedEngineWrapper',
    'DeepSpeedOptimWrapper',
    'DeepSpeedRunner',
    'DsConfigError',
    'MMEngineSettings',
    '__version__',
    'export_checkpoint',
    'init_distributed',
    'register_deepspeed_optimizers',
    'resolve_ds_config',
]
