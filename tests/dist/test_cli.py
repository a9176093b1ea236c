"""The command line end to end: train --nproc, resume, demo, plot, two nodes on loopback."""
from __future__ import annotations

import glob
import json
import os.path as osp
import re
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import REPO_ROOT, free_port, run_command, subprocess_env

pytestmark = pytest.mark.dist

FIXTURES = osp.join(REPO_ROOT, 'tests', 'fixtures')
CONFIG = osp.join(FIXTURES, 'toy_deepspeed.py')
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def cli(*args: str, timeout: float = 300) -> Any:
    return run_command([sys.executable, '-m', 'mmengine_deepspeed', *args], timeout=timeout)


def log_text(work_dir: str) -> str:
    return '\n'.join(open(p, encoding='utf-8').read()
                     for p in sorted(glob.glob(osp.join(work_dir, '*', '*.log'))))


def test_train_nproc_2_then_resume(tmp_path: Any) -> None:
    work = str(tmp_path / 'work')
    first = cli('train', CONFIG, '--nproc', '2', '--zero', '3', '--work-dir', work)
    assert first.returncode == 0, first.stdout[-6000:]
    assert f'logs in {work}' in first.stdout
    log = log_text(work)
    assert 'DeepSpeed engine ready: ZeRO-3, bf16, world size 2, backend gloo' in log
    for fragment in ('grad_norm:', 'samples_per_s:', 'peak_mem_mb:', 'Epoch(train) [2][4/4]',
                     '`mmengine-deepspeed plan` predicts'):
        assert fragment in log, fragment
    # one figure (issue 43): `plan` before launching says what the training log says, both
    # from the same fixed cost (the process after imports, before the config's model and data)
    logged = float(re.search(r'`mmengine-deepspeed plan` predicts (\d+) MiB', log)[1])
    planned = cli('plan', CONFIG, '--nproc', '2', '--zero', '3', '--json')
    assert planned.returncode == 0, planned.stdout[-3000:]
    row = next(r for r in json.loads(planned.stdout[planned.stdout.index('{'):])['rows']
               if (r['stage'], r['offload_optimizer']) == (3, 'none'))
    assert abs(row['peak_mib'] - logged) <= 0.03 * logged, (row['peak_mib'], logged)
    again = cli('train', CONFIG, '--nproc', '2', '--zero', '3', '--work-dir', work, '--resume',
                '--cfg-options', 'train_cfg.max_epochs=3')
    assert again.returncode == 0, again.stdout[-6000:]
    log = log_text(work)
    assert 'Resumed from' in log and 'epoch 2, iter 8' in log
    assert 'Epoch(train) [3][4/4]' in log
    assert osp.isdir(osp.join(work, 'epoch_3.pth'))


def test_bad_config_is_one_clear_line(tmp_path: Any) -> None:
    bad = tmp_path / 'bad.json'
    bad.write_text('{"zero_optimisation": {"stage": 2}}')
    proc = cli('train', CONFIG, '--work-dir', str(tmp_path), '--ds-config', str(bad))
    assert proc.returncode == 2
    assert "mmengine-deepspeed train: error: ds_config has an unknown key 'zero_optimisation'" \
        in proc.stdout


def test_demo_then_plot(tmp_path: Any) -> None:
    work = str(tmp_path / 'demo')
    given = osp.relpath(work, REPO_ROOT)  # the commands run in REPO_ROOT
    proc = cli('demo', '--max-iters', '20', '--work-dir', given)
    assert proc.returncode == 0, proc.stdout[-6000:]
    out = proc.stdout
    # every path in the summary as the user gave the work_dir
    assert f'  checkpoint : {osp.join(given, "iter_20.pth")}\n' in out, out[-2000:]
    assert f'  weights    : {osp.join(given, "demo_gpt.pth")} ' in out, out[-2000:]
    assert 'mmengine-deepspeed demo: 20 iterations, ZeRO-3, 2 processes' in out
    assert 'validation loss' in out and 'unigram baseline' in out
    assert 'sample     :' in out
    # a first impression: one line, the progress bar, validation lines, the summary;
    # MMEngine's environment dump and DeepSpeed's warnings only in the work_dir's log
    assert out.startswith('mmengine-deepspeed demo: a tiny GPT'), out[:2000]
    assert '20/20  loss' in out and 'ETA' in out and 'validation at iteration 20' in out
    for noise in ('System environment', 'Setting accelerator', 'DeepSpeed engine ready'):
        assert noise not in out, noise
    with open(osp.join(work, 'console.log'), encoding='utf-8') as f:
        assert 'System environment' in f.read()
    for name in ('demo_gpt.pth', 'loss_curve.png'):
        assert osp.isfile(osp.join(work, name)), name
    with open(osp.join(work, 'loss_curve.png'), 'rb') as f:
        assert f.read(8) == PNG_SIGNATURE
    target = str(tmp_path / 'curves.png')
    plotted = cli('plot', work, '--out', target)
    assert plotted.returncode == 0, plotted.stdout[-3000:]
    import matplotlib.image
    image = matplotlib.image.imread(target)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_plot_without_logs_is_a_clear_error(tmp_path: Any) -> None:
    proc = cli('plot', str(tmp_path))
    assert proc.returncode == 2 and 'no */vis_data/scalars.json' in proc.stdout


def _two_nodes(work: str, *extra: str) -> list[subprocess.CompletedProcess]:
    """Two torchrun 'nodes' (one rank each) on loopback, like a 2-node job."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, '-m', 'torch.distributed.run', '--nnodes=2', f'--node_rank={rank}',
         '--nproc_per_node=1', '--master_addr=127.0.0.1', f'--master_port={port}',
         osp.join(FIXTURES, 'tools_train.py'), CONFIG, '--launcher', 'pytorch',
         '--work-dir', work, *extra],
        cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True) for rank in (0, 1)]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    return results


def test_two_nodes_on_loopback_train_and_resume(tmp_path: Any) -> None:
    work = str(tmp_path / 'work')
    for node in _two_nodes(work):
        assert node.returncode == 0, node.stdout[-5000:]
    assert 'world size 2' in log_text(work)
    for node in _two_nodes(work, '--cfg-options', 'resume=True', 'train_cfg.max_epochs=3'):
        assert node.returncode == 0, node.stdout[-5000:]
    log = log_text(work)
    assert 'Resumed from' in log and 'Epoch(train) [3][4/4]' in log


@pytest.mark.parametrize('config', ['synthetic_classifier_zero3.py',
                                    'synthetic_classifier_zero3_offload.py'])
def test_example_configs_train(tmp_path: Any, config: str) -> None:
    """The configs/ examples run (shortened); the offload one JIT-builds DeepSpeedCPUAdam once."""
    proc = run_command([sys.executable, '-m', 'mmengine_deepspeed', 'train',
                        osp.join(REPO_ROOT, 'configs', config), '--nproc', '2',
                        '--work-dir', str(tmp_path), '--cfg-options', 'train_cfg.max_epochs=1',
                        'train_cfg.val_interval=1', 'train_dataloader.dataset.size=64',
                        'val_dataloader.dataset.size=64'], timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    log = log_text(str(tmp_path))
    assert 'val/accuracy' in log
    if 'offload' in config:
        assert 'offload optimizer=cpu param=cpu' in log
