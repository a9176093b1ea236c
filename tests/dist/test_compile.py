"""MMEngine's ``compile`` key under DeepSpeedRunner: the engines' modules are compiled.

MMEngine compiles ``model.train_step``, which under DeepSpeed dragged the engine into
dynamo (ZeRO-2 died building guards; ZeRO-3 hit the recompile limit frame after frame and
fell back to eager). Ours compiles the module inside each engine (DeepSpeed's
``engine.compile()``). One launch, 2 ranks, ZeRO 0-3, each compiled (inductor, what
``compile=True`` means) and eager: the weights agree within fp32 tolerance, no graph is
built after the first iterations (no recompilation storm), and the run logs the count.
"""
from __future__ import annotations

import os.path as osp
import re
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist

STAGES = (0, 1, 2, 3)
ITERS = 8
# Validation at iteration 4 compiles the predict mode once; training has compiled by then.
BASE = dict(max_iters=ITERS, val_interval=4, log_level='INFO')


@pytest.fixture(scope='module')
def runs(tmp_path_factory: Any) -> tuple[str, dict[str, list[dict]]]:
    out = str(tmp_path_factory.mktemp('compile'))
    scenarios = []
    for stage in STAGES:
        cfg = dict(BASE, ds_config={'zero_optimization': {'stage': stage}})
        scenarios += [{'name': f'eager{stage}', 'cfg': cfg},
                      {'name': f'compiled{stage}', 'cfg': dict(cfg, compile=True)}]
    scenarios.append({'name': 'many_types3', 'cfg': dict(
        BASE, ds_config={'zero_optimization': {'stage': 3}}, compile=True,
        model=dict(type='ToyManyTypesModel'), val=False)})
    stdout = launch_scenarios('tests/dist/worker.py', out, scenarios, nproc=2)
    results = {s['name']: [torch.load(osp.join(out, f'{s["name"]}.rank{r}.pt'))
                           for r in range(2)] for s in scenarios}
    return stdout, results


@pytest.mark.parametrize('stage', STAGES)
def test_compiled_training_equals_eager_within_fp32_tolerance(runs: Any, stage: int) -> None:
    _, results = runs
    eager, compiled = results[f'eager{stage}'][0], results[f'compiled{stage}'][0]
    assert compiled['compiled'] and not eager['compiled']
    assert compiled['stage'] == stage
    torch.testing.assert_close(compiled['losses'], eager['losses'], rtol=1e-5, atol=1e-5)
    for key, value in eager['state'].items():
        torch.testing.assert_close(compiled['state'][key], value, rtol=1e-5, atol=1e-5)
    assert len(compiled['metrics']) == len(eager['metrics']) > 0
    for got, want in zip(compiled['metrics'], eager['metrics']):
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize('stage', STAGES)
def test_no_graph_is_built_after_the_first_iterations(runs: Any, stage: int) -> None:
    _, results = runs
    for rank in range(2):
        graphs = results[f'compiled{stage}'][rank]['compiled_graphs']
        assert len(graphs) == ITERS
        # the first iteration compiles training; validation after iteration 4 adds predict
        assert graphs[0] == graphs[3] and graphs[4] == graphs[-1], graphs


def test_zero3_hooks_are_not_compiled_once_per_module_type(runs: Any) -> None:
    """DeepSpeed's post-forward and pre-backward hooks ran through dynamo with guards on the
    module: recompiled per module type until dynamo's limit, with a warning per rank, 28 graph
    breaks on a model like this one. They now run untraced."""
    stdout, results = runs
    assert 'recompile_limit' not in stdout and 'cache_size_limit' not in stdout, stdout[-3000:]
    assert results['many_types3'][0]['global_steps'] == ITERS


def test_the_run_says_what_it_compiled_and_where(runs: Any) -> None:
    stdout, _ = runs
    assert stdout.count('applied to the model inside the DeepSpeed engine') == len(STAGES) + 1
    # per rank: the first compiled run builds graphs; a later runner in the same process may
    # reuse them (dynamo guards on the inputs, not on the module instance)
    reports = re.findall(r'torch.compile built (\d+) graphs|torch.compile built no new graph',
                         stdout)
    assert len(reports) == len(STAGES) + 1
    assert int(reports[0]) > 0
