"""Loss and learning-rate curves of a run, from MMEngine's scalar logs, as a PNG."""
from __future__ import annotations

import glob
import json
import os.path as osp
from typing import Optional


def read_scalars(work_dir: str) -> dict[str, dict[int, float]]:
    """Every scalar of every run in ``work_dir`` (``*/vis_data/scalars.json``), by step.

    Later runs (a resume) overwrite earlier values of the same step.
    """
    files = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    if not files:
        raise FileNotFoundError(
            f'no */vis_data/scalars.json under {work_dir!r}: pass the work_dir of a run '
            "(MMEngine's LocalVisBackend writes these).")
    series: dict[str, dict[int, float]] = {}
    for path in files:
        with open(path, encoding='utf-8') as f:
            for line in f:
                record = json.loads(line)
                step = int(record.pop('step'))
                for key, value in record.items():
                    if isinstance(value, (int, float)):
                        series.setdefault(key, {})[step] = float(value)
    return series


def is_loss(key: str) -> bool:
    """Whether a scalar is a loss: ``loss`` in its name, or a validation ``nll`` (the demo's
    metric, named so that MMEngine's log does not average it over validations)."""
    return 'loss' in key or key.endswith('/nll')


def plot_run(work_dir: str, out: Optional[str] = None) -> str:
    """Write the training loss, validation losses and learning rate of ``work_dir``.

    Args:
        work_dir (str): The run's work directory.
        out (str, optional): The PNG to write. Defaults to
            ``WORK_DIR/curves.png``.

    Returns:
        str: The PNG's path.
    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    series = read_scalars(work_dir)
    out = out or osp.join(work_dir, 'curves.png')
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted(series):
        if not is_loss(key):
            continue
        steps = sorted(series[key])
        style = dict(marker='o') if key.startswith('val') else {}
        ax_loss.plot(steps, [series[key][s] for s in steps], label=key, **style)
    ax_loss.set_xlabel('iteration')
    ax_loss.set_ylabel('loss')
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if 'lr' in series:
        steps = sorted(series['lr'])
        ax_lr.plot(steps, [series['lr'][s] for s in steps], color='tab:green')
    ax_lr.set_xlabel('iteration')
    ax_lr.set_ylabel('learning rate')
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
