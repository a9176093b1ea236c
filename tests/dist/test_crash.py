"""A rank SIGKILLed in the middle of a save: the previous checkpoint survives.

With ``max_keep_ckpts=1`` MMEngine's own CheckpointHook deletes the previous
checkpoint before saving the next; ours deletes it after the new one is
complete, so the kill leaves ``iter_4.pth`` complete and named by
``last_checkpoint``, and resuming from it ends exactly where a straight run
does.
"""
from __future__ import annotations

import json
import os.path as osp
from typing import Any

import pytest
import torch

from mmengine_deepspeed.checkpoint.layout import LAST_CHECKPOINT, is_complete
from tests.helpers import run_torchrun

pytestmark = pytest.mark.dist

CFG: dict[str, Any] = dict(
    ds_config={'zero_optimization': {'stage': 3}},
    checkpoint={'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False, 'max_keep_ckpts': 1})


def test_kill_during_save_then_resume(tmp_path: Any) -> None:
    out = str(tmp_path)
    work = osp.join(out, 'crash')
    killed = run_torchrun(['tests/dist/worker.py', out, json.dumps(
        {'name': 'crash', 'cfg': CFG, 'kill_rank1_at_iter': 8})], timeout=200)
    assert killed.returncode != 0
    assert 'Signal 9' in killed.stdout or 'SIGKILL' in killed.stdout, killed.stdout[-3000:]
    assert is_complete(osp.join(work, 'iter_4.pth'))
    assert osp.isdir(osp.join(work, 'iter_8.pth'))
    assert not is_complete(osp.join(work, 'iter_8.pth'))
    with open(osp.join(work, LAST_CHECKPOINT)) as f:
        assert f.read().strip() == osp.join(work, 'iter_4.pth')

    resumed = run_torchrun(['tests/dist/worker.py', out,
                            json.dumps({'name': 'straight', 'cfg': CFG}),
                            json.dumps({'name': 'resumed', 'work_dir': work,
                                        'cfg': dict(CFG, resume=True)})], timeout=200)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert 'Skipping incomplete checkpoint' in resumed.stdout
    for rank in range(2):
        straight = torch.load(osp.join(out, f'straight.rank{rank}.pt'))
        again = torch.load(osp.join(out, f'resumed.rank{rank}.pt'))
        assert again['losses'] == straight['losses'][4:]
        for key, value in straight['state'].items():
            assert torch.equal(value, again['state'][key]), key
    assert is_complete(osp.join(work, 'iter_8.pth'))
    assert not osp.exists(osp.join(work, 'iter_4.pth'))  # max_keep_ckpts=1, after the save


def test_killed_rank_is_restarted_and_resumes_by_itself(tmp_path: Any) -> None:
    """torchrun --max-restarts 1: rank 1 dies (SIGKILL) during the save of iteration 8; the
    elastic agent restarts both, the runner resumes from iter_4.pth on its own, and the
    final weights equal an uninterrupted run's."""
    out = str(tmp_path)
    proc = run_torchrun(['tests/dist/worker.py', out,
                         json.dumps({'name': 'straight', 'cfg': CFG}),
                         json.dumps({'name': 'restarted', 'cfg': CFG, 'kill_rank1_at_iter': 8})],
                        torchrun_args=['--max-restarts=1'], timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert 'Restart 1 of this job: resuming from' in proc.stdout, proc.stdout[-3000:]
    for rank in range(2):
        straight = torch.load(osp.join(out, f'straight.rank{rank}.pt'))
        restarted = torch.load(osp.join(out, f'restarted.rank{rank}.pt'))
        for key, value in straight['state'].items():
            assert torch.equal(value, restarted['state'][key]), key


def test_a_failed_save_says_which_why_and_what_resumes(tmp_path: Any) -> None:
    """Every file write fails from the save of iteration 8 on (RLIMIT_FSIZE, a real write
    error like a full disk's): the run ends with one message naming the checkpoint, the cause
    and the last complete checkpoint, which stays complete (test_kill_during_save_then_resume
    resumes from such a one exactly)."""
    out = str(tmp_path)
    work = osp.join(out, 'failing')
    hooks = [{'type': 'RecorderHook'}, {'type': 'FileSizeLimitHook', 'at_iter': 8}]
    failed = run_torchrun(['tests/dist/worker.py', out, json.dumps(
        {'name': 'failing', 'cfg': dict(CFG, custom_hooks=hooks)})], timeout=200)
    assert failed.returncode != 0
    message = (f'Saving checkpoint {osp.join(work, "iter_8.pth")} failed: ')
    assert message in failed.stdout, failed.stdout[-4000:]
    line = failed.stdout[failed.stdout.index(message):].splitlines()[0]
    assert 'writing a file failed' in line or 'File too large' in line, line
    assert f'which --resume (resume=True) uses, is {osp.join(work, "iter_4.pth")}' in line, line
    assert is_complete(osp.join(work, 'iter_4.pth'))
    assert not is_complete(osp.join(work, 'iter_8.pth'))
