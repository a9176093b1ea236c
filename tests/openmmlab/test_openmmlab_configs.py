"""Real OpenMMLab configs train through their own ``tools/train.py`` with the three lines.

MMDetection (RetinaNet, Faster R-CNN), MMSegmentation (SegFormer) and MMPretrain
(ResNet) configs, each the library's own config plus the three lines and small generated
data (``configs.py``), on 2 CPU ranks at every ZeRO stage (0-3): the library's unchanged
``tools/train.py`` under torchrun trains, validates with the library's metric and
exits 0, and its log gives the plan's prediction. Under ZeRO-3 the model is built
partitioned (``deepspeed.zero.Init``), anchors and drop-path rates included, and
Faster R-CNN's bbox loss module, which a rank without positive RoIs skips, does not
stop DeepSpeed (``zero/unused_params.py``). The tier needs
mmcv with its ops (``.venv-openmmlab``, ``scripts/setup_openmmlab.sh``);
``scripts/test_openmmlab.sh`` runs it.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os.path as osp
import re
import sys
from typing import Any, Callable

import pytest

from tests.helpers import run_command, run_torchrun
from tests.openmmlab import data
from tests.openmmlab.configs import CONFIGS

DATA: dict[str, Callable[[str], str]] = {
    'mmdet': data.coco_detection, 'mmseg': data.ade20k_segmentation,
    'mmpretrain': data.image_folders}


def train_script(library: str) -> str:
    """The library's own ``tools/train.py``, as its package ships it (``.mim``)."""
    spec = importlib.util.find_spec(library)
    assert spec is not None and spec.submodule_search_locations, library
    return osp.join(spec.submodule_search_locations[0], '.mim', 'tools', 'train.py')


@pytest.fixture(scope='module')
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {library: make(str(tmp_path_factory.mktemp(library)))
            for library, make in DATA.items()}


def train(tmp_path: Any, roots: dict[str, str], name: str, stage: int) -> str:
    library, text, _ = CONFIGS[name]
    config = osp.join(str(tmp_path), f'{name}.py')
    with open(config, 'w') as f:
        f.write(text.replace('{root}', roots[library]))
    proc = run_torchrun(
        [train_script(library), config, '--launcher', 'pytorch',
         '--work-dir', osp.join(str(tmp_path), 'work'),
         '--cfg-options', f'ds_config.zero_optimization.stage={stage}'],
        nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-10000:]
    return proc.stdout


CASES = [(name, stage) for name in sorted(CONFIGS) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize('name, stage', CASES)
def test_config_trains_with_the_three_lines(tmp_path: Any, roots: dict[str, str], name: str,
                                            stage: int) -> None:
    log = train(tmp_path, roots, name, stage)
    assert f'DeepSpeed engine ready: ZeRO-{stage}' in log
    if stage == 3:
        assert 'Built the model partitioned under ZeRO-3' in log
        assert 'zero.Init could not build' not in log
    losses = [float(v) for v in re.findall(r'\bloss: ([-\d.e+]+|nan|inf)', log)]
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    metric = CONFIGS[name][2]
    assert re.search(rf'{re.escape(metric)}: [\d.]+', log), log[-4000:]
    # the plan's prediction beside the first peak: traced on the meta device, or (MMDetection's
    # and MMSegmentation's models read values) from what the first iteration saved
    found = re.search(r'after the first iteration: (\d+) MiB; `mmengine-deepspeed plan` '
                      r'predicts (\d+) MiB', log)
    assert found, log[-4000:]
    peak = max(float(v) for v in re.findall(r'peak_mem_mb: ([\d.]+)', log))
    print(f'{name} ZeRO-{stage}: predicted {found[2]} MiB, logged peak {peak:.0f} MiB '
          f'(ratio {int(found[2]) / peak:.3f}; after the first iteration {found[1]} MiB)')


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_plan_sizes_the_config(tmp_path: Any, roots: dict[str, str], name: str) -> None:
    """`mmengine-deepspeed plan` on the same config: every row, on the meta device or, for
    a model whose construction or forward reads values, with one real step (said in the
    notes); never a traceback."""
    library, text, _ = CONFIGS[name]
    config = osp.join(str(tmp_path), f'{name}.py')
    with open(config, 'w') as f:
        f.write(text.replace('{root}', roots[library]))
    proc = run_command([sys.executable, '-m', 'mmengine_deepspeed', 'plan', config,
                        '--nproc', '2', '--json'], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    plan = json.loads(proc.stdout[proc.stdout.index('{'):])
    assert len(plan['rows']) == 8 and all(row['peak_mib'] > 0 for row in plan['rows'])
    if plan['activations']['method'] == 'probe':
        assert any('real' in note for note in plan['notes']), plan['notes']
