"""The benchmarks in their seconds-long smoke mode, so they do not rot (no timing asserts)."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import run_command

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(('script', 'fragment'), [
    ('benchmarks/overhead.py', 'runner/raw min/med/max'),
    ('benchmarks/memory.py', 'after steps vs 16Φ/N'),
    ('benchmarks/checkpoint_cost.py', 'zero_to_fp32 s'),
])
def test_benchmark_smoke(script: str, fragment: str) -> None:
    proc = run_command([sys.executable, script, '--smoke'], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert fragment in proc.stdout
