"""One rank fails while the others are inside a collective: the whole job ends in seconds.

Every case keeps the process group's default timeout (30 minutes) and has rank 1 raise
in its forward at iteration 5, while rank 0 goes on into DeepSpeed's gradient all-reduce.
Before ``failure.py`` rank 0 waited there, and rank 1 in the exit barrier, for the timeout.
"""
from __future__ import annotations

import json
import os
import os.path as osp
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from mmengine_deepspeed.checkpoint.layout import is_complete
from mmengine_deepspeed.failure import PEER_FAILED_EXIT
from tests.helpers import REPO_ROOT, free_port, run_command, run_torchrun
from tests.helpers import subprocess_env as child_env

pytestmark = pytest.mark.dist

# MMEngine's default dist_cfg: no timeout of ours, so torch's 30 minutes apply.
DEFAULT_TIMEOUT = {'dist_cfg': {'backend': 'gloo'}}
ERROR = 'RuntimeError: corrupt sample on rank 1 (training forward 5)'
PEER_LINE = f'[rank 0] stopping: rank 1 failed ({ERROR})'


def failing_cfg(stage: int, **model: Any) -> dict:
    return dict(ds_config={'zero_optimization': {'stage': stage}}, env_cfg=DEFAULT_TIMEOUT,
                model=dict(type='ToyFailingModel', fail_rank=1, fail_iter=5, **model),
                max_iters=12)


def test_one_rank_raising_ends_the_job_under_torchrun(tmp_path: Any) -> None:
    """ZeRO-2 under torchrun: rank 1's error is the one the user sees, rank 0 says why it
    stopped, and the job is over long before any timeout."""
    start = time.monotonic()
    proc = run_torchrun(['tests/dist/worker.py', str(tmp_path), json.dumps(
        {'name': 'fails', 'cfg': failing_cfg(2)})], timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, (elapsed, proc.stdout[-4000:])
    assert ERROR in proc.stdout and 'Traceback' in proc.stdout, proc.stdout[-4000:]
    assert PEER_LINE in proc.stdout, proc.stdout[-4000:]
    assert 'timed out' not in proc.stdout.lower() and 'Timeout' not in proc.stdout
    root_cause = proc.stdout[proc.stdout.index('Root Cause (first observed failure)'):]
    assert 'rank      : 1 (local_rank: 1)' in root_cause, root_cause
    assert ERROR in root_cause, root_cause


def _launch_without_agent(args: list[str], timeout: float) -> tuple[list[int], str, float]:
    """Two ranks as srun or mpirun start them: plain processes, no agent that would kill
    the others when one exits (launcher 'pytorch' reads the same variables)."""
    port = free_port()
    logs, procs = [], []
    start = time.monotonic()
    for rank in range(2):
        env = child_env()
        env.update(RANK=str(rank), WORLD_SIZE='2', LOCAL_RANK=str(rank),
                   MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
        log = open(osp.join(args[1], f'rank{rank}.out'), 'w+')  # noqa: SIM115
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start))))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            codes.append(-9)
    elapsed = time.monotonic() - start
    output = ''
    for rank, log in enumerate(logs):
        log.seek(0)
        output += f'--- rank {rank}\n{log.read()}'
        log.close()
    return codes, output, elapsed


def test_one_rank_raising_ends_the_job_without_an_agent(tmp_path: Any) -> None:
    """ZeRO-3, no torchrun (srun / mpirun): nothing outside the ranks stops rank 0, so
    only the failure channel can; rank 0 leaves with PEER_FAILED_EXIT."""
    out = str(tmp_path)
    codes, output, elapsed = _launch_without_agent(
        ['tests/dist/worker.py', out, json.dumps({'name': 'fails', 'cfg': failing_cfg(3)})],
        timeout=120)
    assert elapsed < 60, (elapsed, output[-4000:])
    assert codes[0] == PEER_FAILED_EXIT and codes[1] == 1, (codes, output[-4000:])
    rank0, rank1 = output.split('--- rank 1\n')
    assert PEER_LINE in rank0, rank0[-3000:]
    assert ERROR in rank1 and 'Traceback' in rank1, rank1[-3000:]


def test_one_rank_failing_the_split_ends_the_job_in_its_agreement(tmp_path: Any) -> None:
    """``layout.micro_batches='auto'``: rank 1's prediction raises (a test double) while
    rank 0 waits in the all-reduce that agrees on the split, no torchrun: rank 1's error
    names the key and the fix, and rank 0 leaves with PEER_FAILED_EXIT in seconds."""
    out = str(tmp_path)
    cfg = dict(env_cfg=DEFAULT_TIMEOUT, max_iters=2, batch_size=2, with_bn=False,
               layout={'world_size': 2, 'micro_batches': 'auto'})
    codes, output, elapsed = _launch_without_agent(
        ['tests/dist/worker.py', out, json.dumps({'name': 'split_fails', 'cfg': cfg,
                                                  'prediction_on_rank1': 'failing'})],
        timeout=120)
    assert elapsed < 60, (elapsed, output[-4000:])
    assert codes[0] == PEER_FAILED_EXIT and codes[1] == 1, (codes, output[-4000:])
    rank0, rank1 = output.split('--- rank 1\n')
    assert "layout.micro_batches='auto' chooses the split" in rank1, rank1[-3000:]
    assert 'no prediction on rank 1 (a test double)' in rank1, rank1[-3000:]
    assert '[rank 0] stopping: rank 1 failed' in rank0, rank0[-3000:]


SPLIT_AUTO = dict(env_cfg=DEFAULT_TIMEOUT, max_iters=2, batch_size=2, with_bn=False,
                  layout={'world_size': 2, 'micro_batches': 'auto'})


def test_out_of_memory_at_one_sample_ends_every_rank_with_the_fix(tmp_path: Any) -> None:
    """``micro_batches='auto'``: rank 1 runs out of memory at every forward (a test double
    of CUDA's error): every rank retries in micro-batches of 1, it runs out again, and
    every rank raises the error that says what to change, in seconds."""
    out = str(tmp_path)
    codes, output, elapsed = _launch_without_agent(
        ['tests/dist/worker.py', out, json.dumps({
            'name': 'never_fits', 'cfg': SPLIT_AUTO, 'out_of_memory_on_rank1': {'at': 'every'}})],
        timeout=120)
    assert elapsed < 60, (elapsed, output[-4000:])
    assert codes[0] != 0 and codes[1] != 0, (codes, output[-4000:])
    rank0, rank1 = output.split('--- rank 1\n')
    assert 'rank 1 ran out of memory with each virtual rank\'s batch of 2 in 1 micro-batch' \
        in rank0, rank0[-3000:]
    assert "layout.micro_batches='auto': rank 1 ran out of memory at one sample per " \
        'micro-batch: raise the ZeRO stage or offload' in rank1, rank1[-3000:]


def test_out_of_memory_before_a_models_collective_ends_every_rank(tmp_path: Any) -> None:
    """Rank 1 runs out of memory (a test double) before the all-reduce its model's forward
    runs, where rank 0 waits: rank 1 waits for the retry's agreement a bounded time (3 s
    here), then fails with its error and why it was not retried; rank 0 leaves with
    PEER_FAILED_EXIT. Without the bound both would wait for the 30-minute timeout."""
    out = str(tmp_path)
    codes, output, elapsed = _launch_without_agent(
        ['tests/dist/worker.py', out, json.dumps({
            'name': 'collective', 'cfg': SPLIT_AUTO, 'collective_in_forward': True,
            'retry_wait_s': 3, 'out_of_memory_on_rank1': {'at': [1], 'in': 'forward'}})],
        timeout=120)
    assert elapsed < 60, (elapsed, output[-4000:])
    assert codes[0] == PEER_FAILED_EXIT and codes[1] == 1, (codes, output[-4000:])
    rank0, rank1 = output.split('--- rank 1\n')
    assert 'torch.OutOfMemoryError: CUDA out of memory (a test double on rank 1) ' \
        "(layout.micro_batches='auto' would retry" in rank1, rank1[-3000:]
    assert 'did not reach the agreement within' in rank1, rank1[-3000:]
    assert '[rank 0] stopping: rank 1 failed' in rank0, rank0[-3000:]


def test_cli_restarts_after_a_raise_and_resumes(tmp_path: Any) -> None:
    """``mmengine-deepspeed train --nproc 2 --max-restarts 1``: rank 1 raises at iteration 5
    of the first attempt; both restart, resume from iter_4.pth and finish, and the weights
    equal a run that never failed."""
    work = str(tmp_path / 'work')
    config = osp.join(REPO_ROOT, 'tests', 'fixtures', 'toy_deepspeed.py')
    common = ['--nproc', '2', '--zero', '2', '--cfg-options', 'train_cfg.max_epochs=3',
              'default_hooks.checkpoint.interval=4', 'default_hooks.checkpoint.by_epoch=False',
              'env_cfg.dist_cfg.timeout=1800']
    start = time.monotonic()
    proc = run_command([sys.executable, '-m', 'mmengine_deepspeed', 'train', config,
                        '--work-dir', work, '--max-restarts', '1', *common,
                        'model.type=ToyFailingModel', 'model.first_attempt_only=True'],
                       timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert ERROR in proc.stdout, proc.stdout[-6000:]
    assert 'Restart 1 of this job: resuming from' in proc.stdout, proc.stdout[-4000:]
    assert is_complete(osp.join(work, 'iter_12.pth'))
    straight = str(tmp_path / 'straight')
    ref = run_command([sys.executable, '-m', 'mmengine_deepspeed', 'train', config,
                       '--work-dir', straight, *common], timeout=300)
    assert ref.returncode == 0, ref.stdout[-6000:]
    assert time.monotonic() - start < 240
    for name in ('deepspeed/mp_rank_00_model_states.pt',):
        a = torch.load(osp.join(work, 'iter_12.pth', name), weights_only=False)['module']
        b = torch.load(osp.join(straight, 'iter_12.pth', name), weights_only=False)['module']
        for key, value in b.items():
            assert torch.equal(value, a[key]), key


# ---------------------------------------------------------------------------------------
# Preemption: a stop signal on ONE rank, mid-iteration; every rank saves and leaves.

def preempt_cfg(stage: int, at_iter: int, by_epoch: bool, **extra: Any) -> dict:
    hooks = [{'type': 'RecorderHook'}, {'type': 'SignalHook', 'at_iter': at_iter, **extra}]
    checkpoint = ({'type': 'CheckpointHook', 'interval': 1, 'by_epoch': True} if by_epoch else
                  {'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False,
                   'max_keep_ckpts': 2})
    return dict(ds_config={'zero_optimization': {'stage': stage}}, by_epoch=by_epoch,
                max_epochs=3, max_iters=12, checkpoint=checkpoint, custom_hooks=hooks)


def _same_run(out: str, a: str, b: str) -> None:
    for rank in range(2):
        x = torch.load(osp.join(out, f'{a}.rank{rank}.pt'))
        y = torch.load(osp.join(out, f'{b}.rank{rank}.pt'))
        assert x['losses'][-3:] == y['losses'][-3:]
        for key, value in x['state'].items():
            assert torch.equal(value, y['state'][key]), key


def test_sigterm_on_one_rank_saves_and_stops_every_rank(tmp_path: Any) -> None:
    """ZeRO-3, epoch-based loop (4 iterations an epoch) with an epoch-based CheckpointHook:
    SIGTERM reaches rank 1 only, during iteration 6, and again while the checkpoint is
    written. Both ranks stop after iteration 6 with status 143, ``iter_6.pth`` is complete
    and named by ``last_checkpoint``; resuming it ends where a run never stopped does."""
    out = str(tmp_path)
    work = osp.join(out, 'stopped')
    cfg = preempt_cfg(3, 6, by_epoch=True, again_during_save=True)
    proc = run_torchrun(['tests/dist/worker.py', out, json.dumps({'name': 'stopped', 'cfg': cfg})],
                        timeout=200)
    assert proc.returncode != 0
    assert 'exitcode  : 143' in proc.stdout, proc.stdout[-4000:]
    assert proc.stdout.count('SIGTERM received') == 1, proc.stdout[-4000:]
    path = osp.join(work, 'iter_6.pth')
    assert f'SIGTERM reached rank 1: stopped after iteration 6 and saved {path}' in proc.stdout
    assert is_complete(path)
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == path
    assert not osp.exists(osp.join(work, 'iter_7.pth')) and not osp.exists(
        osp.join(work, 'epoch_2.pth'))
    cfg_resumed = dict(cfg, custom_hooks=[{'type': 'RecorderHook'}], resume=True)
    proc = run_torchrun(['tests/dist/worker.py', out,
                         json.dumps({'name': 'resumed', 'work_dir': work, 'cfg': cfg_resumed}),
                         json.dumps({'name': 'straight',
                                     'cfg': dict(cfg, custom_hooks=[{'type': 'RecorderHook'}])})],
                        timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    _same_run(out, 'resumed', 'straight')


def test_sigusr1_then_elastic_restart_resumes_exactly(tmp_path: Any) -> None:
    """ZeRO-2, iteration-based loop and CheckpointHook (interval 4, max_keep_ckpts 2):
    SIGUSR1 on rank 1 in iteration 6; the checkpoint is the hook's own ``iter_6.pth`` (in
    its rotation), torchrun --max-restarts=1 restarts both ranks, they resume from it by
    themselves, and the run ends exactly where an uninterrupted one does."""
    out = str(tmp_path)
    cfg = preempt_cfg(2, 6, by_epoch=False, sig='SIGUSR1')
    proc = run_torchrun(['tests/dist/worker.py', out,
                         json.dumps({'name': 'preempted', 'cfg': cfg}),
                         json.dumps({'name': 'straight', 'cfg': dict(
                             cfg, custom_hooks=[{'type': 'RecorderHook'}])})],
                        torchrun_args=['--max-restarts=1'], timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    work = osp.join(out, 'preempted')
    assert f'SIGUSR1 reached rank 1: stopped after iteration 6 and saved ' \
           f'{osp.join(work, "iter_6.pth")}' in proc.stdout, proc.stdout[-4000:]
    assert 'Restart 1 of this job: resuming from' in proc.stdout
    assert sorted(os.listdir(work)).count('iter_6.pth') == 0  # rotated out: keep 2 (8, 12)
    assert is_complete(osp.join(work, 'iter_12.pth')) and is_complete(osp.join(work, 'iter_8.pth'))
    _same_run(out, 'preempted', 'straight')
