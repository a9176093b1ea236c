"""The runner's own switches in a config (``zero_init``, ``allow_unsafe_checkpoints``).

A config is Python: ``zero_init='no'`` would read as True through ``bool()``. The runner
and ``plan`` read each switch here, where anything but True or False is refused.
"""
from __future__ import annotations

from typing import Any, Optional


def switch(cfg: Any, key: str, value: Optional[bool],
           default: bool) -> bool:
    """A runner argument (``value``), else the config's ``key``, else ``default``.

    Args:
        cfg (Config | dict | None): The MMEngine config, if any.
        key (str): The switch's name, in the config and in the error.
        value (bool, optional): The runner's argument; None reads the config.
        default (bool): Where neither gives one.

    Raises:
        ValueError: The value chosen is not a bool, naming the key and the value.
    """
    if value is None:
        value = cfg.get(key, default) if cfg is not None else default
    if not isinstance(value, bool):
        raise ValueError(f'{key}={value!r}: give True or False (a string or a number is not '
                         'read as a switch).')
    return value
