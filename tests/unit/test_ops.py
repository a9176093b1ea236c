"""ops.py: DeepSpeed's JIT ops cached per install, the CPU inference op not built."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmengine_deepspeed import ops


def test_each_install_has_its_own_extensions_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two checkouts (two DeepSpeed paths) never share, hence never rebuild, an op's cache;
    one install under one torch always finds the same directory."""
    monkeypatch.setenv('XDG_CACHE_HOME', '/cache')
    first = ops.extensions_dir('/a/.venv/lib/site-packages/deepspeed', '2.13.0+cpu')
    assert first == ops.extensions_dir('/a/.venv/lib/site-packages/deepspeed', '2.13.0+cpu')
    assert first.startswith('/cache/torch_extensions/mmengine_deepspeed/py')
    assert first != ops.extensions_dir('/b/.venv/lib/site-packages/deepspeed', '2.13.0+cpu')
    assert first != ops.extensions_dir('/a/.venv/lib/site-packages/deepspeed', '2.12.0+cpu')


@pytest.mark.parametrize('user_dir', [None, '/mine'])
def test_importing_the_package_sets_the_dir_unless_the_user_did(user_dir: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != ops.EXTENSIONS_DIR_VARIABLE}
    if user_dir is not None:
        env[ops.EXTENSIONS_DIR_VARIABLE] = user_dir
    out = subprocess.run(
        [sys.executable, '-c', 'import os, mmengine_deepspeed.ops as o, deepspeed, torch; '
         'print("DIR", os.environ["TORCH_EXTENSIONS_DIR"]); '
         'print("DIR", o.extensions_dir(os.path.dirname(deepspeed.__file__), torch.__version__))'],
        env=env, capture_output=True, text=True, check=True).stdout
    # importing mmengine_deepspeed.ops runs the package's __init__
    found, expected = [line.split()[1] for line in out.splitlines() if line.startswith('DIR ')]
    assert found == (user_dir or expected)
