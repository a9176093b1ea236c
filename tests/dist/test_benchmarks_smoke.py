"""The benchmarks in their seconds-long smoke mode, so they do not rot (no timing asserts)."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import run_command

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(('command', 'fragments'), [
    ('benchmarks/overhead.py --profile --unused --compiled --host-bound --peak-tflops 1',
     ('runner/raw min/med/max', 'runner MFU', 'collective waits', 'mmengine_deepspeed',
      'find_unused/runner min/med/max', 'check ms/iter', 'compiled/eager min/med/max',
      "py-spy's samples", '| deep12 | ZeRO-2 |')),
    ('benchmarks/memory.py', ('tensors vs 16Φ/N', 'tensors vs layout')),
    ('benchmarks/checkpoint_cost.py', ('save ratio min/med/max', 'zero_to_fp32 command s')),
    ('benchmarks/gan.py --profile', ('runner/raw min/med/max', 'mmengine_deepspeed')),
    ('benchmarks/stop_and_resume.py', ('agreement / step', 'DeepSpeedRunner s to first step')),
    ('benchmarks/plan_accuracy.py', ('plan/measured', 'Accelerate MiB', 'DeepSpeed MiB',
                                      'within the target')),
    ('benchmarks/history.py', ("MMEngine's MessageHub ms/iter", '| 10000 |')),
    ('benchmarks/layout.py', ('accumulation/layout min/med/max', '| 2 |')),
    ('benchmarks/scale.py --cold', ('construction MiB', 'DeepSpeed estimate MiB', 'zero3_init',
                             'Largest measured size')),
])
def test_benchmark_smoke(command: str, fragments: tuple[str, ...]) -> None:
    proc = run_command([sys.executable, *command.split(), '--smoke'], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for fragment in fragments:
        assert fragment in proc.stdout, proc.stdout[-6000:]
