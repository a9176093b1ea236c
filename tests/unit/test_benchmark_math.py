"""The arithmetic behind the benchmark tables (MFU, DeepSpeed's memory layout, profile rows)."""
from __future__ import annotations

import pytest

from benchmarks.common import peak_tflops, train_flops_per_token
from benchmarks.memory import expected_bytes
from benchmarks.overhead_worker import package_of


def test_train_flops_per_token_counts_parameters_and_attention() -> None:
    cfg = dict(depth=18, block_size=1024, width=768)
    assert train_flops_per_token('gpt125m', 10) == 6 * 10 + 12 * cfg['depth'] * \
        cfg['block_size'] * cfg['width']
    assert train_flops_per_token('tiny', 4352) == 6 * 4352  # no attention


@pytest.mark.parametrize(('name', 'peak'), [
    ('NVIDIA H200', 989.4), ('NVIDIA A100-SXM4-80GB', 312.0), ('NVIDIA A10G', 70.0),
    ('NVIDIA L40S', 362.1), ('Some Future GPU', None)])
def test_peak_tflops_by_device_name(name: str, peak: float) -> None:
    assert peak_tflops(name) == peak


def test_expected_bytes_follow_deepspeed_layout() -> None:
    phi, n = 1000, 2
    assert expected_bytes(0, phi, n, bucket=7) == 12 * phi
    assert expected_bytes(2, phi, n, bucket=7) == 4 * phi + 12 * phi / n
    assert expected_bytes(3, phi, n, bucket=7) == 20 * phi / n + 4 * 7
    # ZeRO-3's model states shrink as 1/N; only the bucket does not
    assert expected_bytes(3, phi, 4, bucket=0) == expected_bytes(3, phi, 2, bucket=0) / 2


def test_profile_rows() -> None:
    site = '/venv/lib/python3.11/site-packages'
    assert package_of(f'{site}/mmengine/runner/loops.py', 'run_iter') == 'mmengine'
    assert package_of('/repo/mmengine_deepspeed/engine/wrapper.py', 'train_step') \
        == 'mmengine_deepspeed'
    assert package_of(f'{site}/deepspeed/runtime/engine.py', 'step') == 'deepspeed'
    assert package_of('~', "<built-in method torch._C._distributed_c10d.wait>") == \
        'collective waits'
    assert package_of('~', '<built-in method torch._C._nn.linear>') == 'C / C++ ops'
