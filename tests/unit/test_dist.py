"""dist.py: backends, launchers' environments, refusals."""
from __future__ import annotations

import pytest
import torch.distributed as torch_dist

from mmengine_deepspeed.dist import _launcher_env, choose_backend, init_distributed


def test_backend_choice() -> None:
    assert choose_backend(None, has_cuda=False) == 'gloo'
    assert choose_backend(None, has_cuda=True) == 'nccl'
    assert choose_backend('nccl', has_cuda=False) == 'gloo'
    assert choose_backend('nccl', has_cuda=True) == 'nccl'
    assert choose_backend('gloo', has_cuda=True) == 'gloo'


def test_launcher_env_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('SLURM_PROCID', '3')
    monkeypatch.setenv('SLURM_NTASKS', '8')
    monkeypatch.setenv('SLURM_LOCALID', '1')
    monkeypatch.setenv('MASTER_ADDR', 'node7')
    monkeypatch.delenv('MASTER_PORT', raising=False)
    env = _launcher_env('slurm', port=None)
    assert (env['RANK'], env['WORLD_SIZE'], env['LOCAL_RANK'], env['MASTER_ADDR'],
            env['MASTER_PORT']) == ('3', '8', '1', 'node7', '29500')


def test_launcher_env_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('OMPI_COMM_WORLD_RANK', '1')
    monkeypatch.setenv('OMPI_COMM_WORLD_SIZE', '2')
    monkeypatch.setenv('OMPI_COMM_WORLD_LOCAL_RANK', '1')
    env = _launcher_env('mpi', port=12345)
    assert (env['RANK'], env['WORLD_SIZE'], env['LOCAL_RANK'], env['MASTER_PORT']) == \
        ('1', '2', '1', '12345')


def test_launcher_env_pytorch_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ('RANK', 'WORLD_SIZE'):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match='torchrun'):
        _launcher_env('pytorch', port=None)


def test_launcher_none_is_one_rank() -> None:
    env = _launcher_env('none', port=None)
    assert (env['RANK'], env['WORLD_SIZE']) == ('0', '1')
    assert int(env['MASTER_PORT']) > 0


def test_bad_launcher_and_dist_cfg_are_refused() -> None:
    with pytest.raises(ValueError, match="launcher='ssh'"):
        init_distributed('ssh')
    if not torch_dist.is_initialized():
        with pytest.raises(ValueError, match=r"\['init_method'\]"):
            init_distributed('none', {'init_method': 'tcp://x'})
