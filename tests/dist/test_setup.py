"""Process setup: launchers, the CPU ``init_dist`` trap, timeouts, the tools/train.py pattern."""
from __future__ import annotations

import glob
import os.path as osp
import sys
import time
from typing import Any

import pytest
import torch

from tests.helpers import REPO_ROOT, free_port, run_command, run_torchrun

pytestmark = pytest.mark.dist

FIXTURES = osp.join(REPO_ROOT, 'tests', 'fixtures')
ONE_RANK_ENV = {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'MASTER_ADDR': '127.0.0.1'}


def _one_rank(code: str) -> Any:
    env = dict(ONE_RANK_ENV, MASTER_PORT=str(free_port()))
    return run_command([sys.executable, '-c', code], timeout=120, extra_env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason='the trap exists only without CUDA')
def test_mmengine_init_dist_fails_without_cuda() -> None:
    """Pins the upstream trap our dist.py works around: MMEngine calls torch.cuda.set_device."""
    proc = _one_rank("from mmengine.dist import init_dist; init_dist('pytorch', backend='gloo')")
    assert proc.returncode != 0
    assert 'cuda' in proc.stdout.lower() or 'CUDA' in proc.stdout, proc.stdout[-3000:]


def test_our_init_distributed_works_for_the_pytorch_launcher() -> None:
    """MMEngine's default env_cfg asks for nccl; without CUDA we fall back to gloo."""
    proc = _one_rank(
        'import torch.distributed as d\n'
        'from mmengine_deepspeed.dist import init_distributed\n'
        "init_distributed('pytorch', dict(backend='nccl', timeout=30))\n"
        'print("BACKEND", d.get_backend(), d.get_world_size())')
    assert proc.returncode == 0, proc.stdout[-3000:]
    expected = 'nccl' if torch.cuda.is_available() else 'gloo'
    assert f'BACKEND {expected} 1' in proc.stdout


def test_dead_peer_does_not_hang_the_others(tmp_path: Any) -> None:
    """env_cfg.dist_cfg.timeout reaches the process group: rank 0 gives up in time."""
    start = time.monotonic()
    proc = run_torchrun(['tests/dist/timeout_worker.py', str(tmp_path), '5'], timeout=200)
    elapsed = time.monotonic() - start
    assert 'TIMED_OUT_AFTER' in proc.stdout, proc.stdout[-4000:]
    waited = float(proc.stdout.split('TIMED_OUT_AFTER ')[1].split()[0])
    assert 4.0 <= waited < 30.0
    assert proc.returncode != 0
    assert elapsed < 100  # torchrun tore rank 1 down instead of waiting out its sleep


def _log_text(work_dir: str) -> str:
    logs = glob.glob(osp.join(work_dir, '*', '*.log'))
    assert logs, f'no log under {work_dir}'
    return open(logs[0], encoding='utf-8').read()


@pytest.mark.parametrize('tool', ['tools_train.py', 'tools_train_from_cfg.py'])
def test_unchanged_tools_train_py_trains_with_the_three_lines(tmp_path: Any, tool: str) -> None:
    """OpenMMLab's tools/train.py patterns + a config that only adds the three lines: the
    script that builds ``RUNNERS.build(cfg)`` for a ``runner_type`` (MMDetection's), and the
    one that calls ``Runner.from_cfg(cfg)`` whatever the config says (MMagic's; it trained a
    plain Runner on one rank and died in MMEngine's init_dist on 2 CPU ranks)."""
    work_dir = str(tmp_path / 'work')
    proc = run_torchrun([osp.join(FIXTURES, tool),
                         osp.join(FIXTURES, 'toy_deepspeed.py'),
                         '--launcher', 'pytorch', '--work-dir', work_dir])
    assert proc.returncode == 0, proc.stdout[-6000:]
    log = _log_text(work_dir)
    assert 'DeepSpeed engine ready: ZeRO-2, bf16, world size 2' in log
    assert 'accuracy:' in log
    assert 'Epoch(train) [2][4/4]' in log


def test_cli_train_with_launcher_none(tmp_path: Any) -> None:
    """One process, no launcher: still a DeepSpeed engine (on a one-rank group)."""
    work_dir = str(tmp_path / 'work')
    proc = run_command([sys.executable, '-m', 'mmengine_deepspeed', 'train',
                        osp.join(FIXTURES, 'toy_deepspeed.py'), '--work-dir', work_dir,
                        '--cfg-options', 'train_cfg.max_epochs=1'], timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    log = _log_text(work_dir)
    assert 'DeepSpeed engine ready: ZeRO-2, bf16, world size 1' in log
    assert 'Epoch(train) [1][8/8]' in log


def _bucket_run(tmp_path: Any, stage: int) -> tuple[float, float, int, int]:
    proc = run_command([sys.executable, 'tests/dist/bucket_worker.py', str(tmp_path), str(stage)],
                       timeout=180, extra_env=dict(ONE_RANK_ENV, MASTER_PORT=str(free_port())))
    assert proc.returncode == 0, proc.stdout[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith('RAW '))
    _, raw, _, runner, _, bucket, _, trainable = line.split()
    return float(raw), float(runner), int(bucket), int(trainable)


def test_zero3_reduce_bucket_is_sized_to_the_model(tmp_path: Any) -> None:
    """Pins what DeepSpeed 0.19 does with its default reduce_bucket_size under ZeRO-3 (the
    whole 5e8-element buffer up front) next to the runner, which holds it to the gradients of
    a model smaller than one bucket."""
    raw, runner, bucket, trainable = _bucket_run(tmp_path, 3)
    assert raw >= 500_000_000
    assert bucket == trainable
    assert runner < 2**20  # nothing near DeepSpeed's default left


def test_zero2_deterministic_run_pays_no_bucket(tmp_path: Any) -> None:
    """Pins DeepSpeed 0.19's ZeRO-2 allocating its 5e8-element (2 GB) reduce bucket at every
    backward, which torch's deterministic mode (MMEngine's ``randomness.deterministic``)
    fills: the raw engine's peak RSS passes 2 GB after one backward of a 212-parameter model,
    while the runner, its bucket sized to the model, trains it in a fraction of that."""
    raw, runner, bucket, trainable = _bucket_run(tmp_path, 2)
    assert raw > 2000  # MiB
    assert bucket == trainable
    assert runner < 1000


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason='DeepSpeed #8499: under ZeRO-3, load_checkpoint(..., '
                          'load_optimizer_states=False) ignores tag (our load_from avoids it)')
def test_deepspeed_zero3_load_honours_tag(tmp_path: Any) -> None:
    """Pins DeepSpeed #8499 (our load_from is tested in test_checkpoint.py): loading tag A
    loads B's weights. When DeepSpeed fixes it, this passes and the strict xfail says so."""
    proc = run_command([sys.executable, 'tests/dist/ds8499_worker.py', str(tmp_path)],
                       timeout=120)
    if proc.returncode != 0:  # not the expected failure: an error, not an xfail
        raise RuntimeError(proc.stdout[-3000:])
    assert 'LOADED_A True' in proc.stdout, proc.stdout[-3000:]


def test_bf16_auto_trains_in_fp32_on_a_cpu_without_native_bf16(tmp_path: Any) -> None:
    """The demo's and example configs' bf16 "auto", on a CPU that would emulate bf16 (the
    CPU probe is replaced in the worker: this machine's CPU may have AVX512-BF16)."""
    proc = run_command([sys.executable, 'tests/dist/bf16_worker.py', str(tmp_path)],
                       timeout=180, extra_env=dict(ONE_RANK_ENV, MASTER_PORT=str(free_port())))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert 'PRECISION fp32 float32' in proc.stdout
    lines = [line for line in _log_text(str(tmp_path)).splitlines()
             if 'bf16.enabled="auto": training in fp32' in line]
    assert len(lines) == 1, lines
