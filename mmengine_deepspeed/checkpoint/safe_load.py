"""Loading checkpoint files without trusting their pickles.

``torch.load`` unpickles, and a pickle can run any code. Our own files are
written with plain types only and read with ``weights_only=True``. DeepSpeed
reads its shards itself with full unpickling, so before handing it a
directory every shard's pickle is scanned (without loading any tensor) for
globals outside a short allow-list of the classes DeepSpeed writes; anything
else is refused unless the user opts in with ``allow_unsafe_checkpoints``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from .layout import CheckpointError

# Classes DeepSpeed 0.19 pickles into its shards (ZeRO optimizer states):
# plain records and enums whose unpickling runs no user-chosen code.
DEEPSPEED_GLOBALS = (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)
ALLOWED_NAMES = frozenset(f'{cls.__module__}.{cls.__qualname__}' for cls in DEEPSPEED_GLOBALS)

UNSAFE_HINT = ('If you trust where it came from, pass allow_unsafe_checkpoints=True to '
               'DeepSpeedRunner (or set it in the config) to load it with full unpickling.')


def unsafe_globals(path: str) -> list[str]:
    """Globals the pickle in ``path`` references beyond torch's and our allow-list."""
    found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    return sorted(name for name in found if name not in ALLOWED_NAMES)


def check_pickles(paths: Iterable[str], allow_unsafe: bool) -> None:
    """Refuse files whose pickles reference anything outside the allow-list.

    Args:
        paths (Iterable[str]): ``torch.save`` files.
        allow_unsafe (bool): Skip the check (the user trusts the source).
    """
    if allow_unsafe:
        return
    for path in paths:
        try:
            bad = unsafe_globals(path)
        except Exception as e:
            raise CheckpointError(f'{path} cannot be checked for unsafe content: {e}') from e
        if bad:
            raise CheckpointError(
                f'{path} references {bad}, which a checkpoint of ours never contains; loading '
                f'it could run arbitrary code. {UNSAFE_HINT}')


def safe_load(path: str, allow_unsafe: bool = False, map_location: Any = 'cpu') -> Any:
    """``torch.load`` with ``weights_only=True`` (DeepSpeed's classes allowed).

    Args:
        path (str): A ``torch.save`` file.
        allow_unsafe (bool): Load with full unpickling instead. Defaults to
            False.
        map_location (Any): As for ``torch.load``. Defaults to ``'cpu'``.

    Returns:
        Any: The loaded object.
    """
    if allow_unsafe:
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        with torch.serialization.safe_globals(list(DEEPSPEED_GLOBALS)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if 'Unsupported global' in str(e) or 'weights_only' in str(e).lower():
            raise CheckpointError(
                f'{path} holds objects beyond tensors and plain Python types and was refused: '
                f'loading it could run arbitrary code. {UNSAFE_HINT}') from e
        raise CheckpointError(f'{path} cannot be read: {e}') from e
