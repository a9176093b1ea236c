"""plan/planner.py, plan/memory.py and `mmengine-deepspeed plan`: rows, JSON, recommendation."""
from __future__ import annotations

import glob
import json
import os.path as osp
import re
from typing import Any

import pytest
from mmengine.registry import MODELS

import mmengine_deepspeed.demo  # noqa: F401  registers TinyGPT
from mmengine_deepspeed.cli import main
from mmengine_deepspeed.plan.activations import Activations
from mmengine_deepspeed.plan.census import EngineCensus
from mmengine_deepspeed.plan.memory import MemoryLayout, engine_bytes
from tests.helpers import ToyModel

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
ROW_KEYS = {'stage', 'offload_optimizer', 'offload_param', 'micro_batch', 'peak_mib', 'host_mib',
            'construct_mib', 'fits', 'max_micro_batch', 'mib_per_sample', 'why'}
DEMO = osp.join(ROOT, 'configs', 'demo_gpt_zero3.py')
TOY = osp.join(ROOT, 'tests', 'fixtures', 'toy_deepspeed.py')


def _plan_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert main(['plan', *args, '--json']) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope='module')
def demo_plan() -> dict:
    """The demo planned on 2 ranks of 8 GiB (one plan for several tests)."""
    from mmengine.config import Config

    from mmengine_deepspeed.plan.planner import make_plan

    return make_plan(Config.fromfile(DEMO), nproc=2, device_memory_gib=8).as_json()


def test_json_has_a_row_per_stage_and_offload_and_recommends_the_fastest_that_fits(
        demo_plan: dict) -> None:
    plan = demo_plan
    assert plan['nproc'] == 2 and len(plan['rows']) == 8
    assert all(set(row) == ROW_KEYS for row in plan['rows'])
    assert [(r['stage'], r['offload_optimizer'], r['offload_param']) for r in plan['rows']] == [
        (0, 'none', 'none'), (1, 'none', 'none'), (2, 'none', 'none'), (3, 'none', 'none'),
        (1, 'cpu', 'none'), (2, 'cpu', 'none'), (3, 'cpu', 'none'), (3, 'cpu', 'cpu')]
    assert all(r['micro_batch'] == 16 and r['fits'] and r['max_micro_batch'] >= 16
               for r in plan['rows'])
    assert plan['recommended'] == plan['rows'][0]
    assert plan['activations']['method'] == 'traced'


def test_nothing_fits_a_tiny_budget_and_the_text_says_what_to_do(
        capsys: pytest.CaptureFixture) -> None:
    plan = _plan_json(capsys, TOY, '--nproc', '2', '--device-memory', '0.01')
    assert plan['recommended'] is None
    assert not any(r['fits'] for r in plan['rows'])
    assert all(r['max_micro_batch'] == 0 for r in plan['rows'])
    assert main(['plan', TOY, '--device-memory', '0.01']) == 0
    assert 'nothing fits' in capsys.readouterr().out


def test_the_largest_micro_batch_is_where_the_peak_crosses_the_budget(
        demo_plan: dict, capsys: pytest.CaptureFixture) -> None:
    base = demo_plan['rows'][0]
    budget_gib = (base['peak_mib'] + 200) / 1024
    row = _plan_json(capsys, DEMO, '--nproc', '2', '--device-memory', str(budget_gib))['rows'][0]
    assert row['max_micro_batch'] > 16
    bigger = _plan_json(capsys, DEMO, '--nproc', '2', '--cfg-options',
                        f'train_dataloader.batch_size={row["max_micro_batch"] + 1}',
                        '--device-memory', str(budget_gib))['rows'][0]
    assert not bigger['fits']


def test_text_output_ends_with_ds_config_lines_to_paste(capsys: pytest.CaptureFixture) -> None:
    assert main(['plan', TOY, '--nproc', '2', '--zero', '3']) == 0
    out = capsys.readouterr().out
    assert "engine 'model'" in out and 'traced on the meta device' in out
    assert 'SGD keeps 1 state(s) per trained element' in out
    assert 'ds_config = dict(zero_optimization=dict(stage=0), bf16=dict(enabled=True))' in out


def test_a_layout_is_planned_as_one_virtual_rank_at_a_time(
        capsys: pytest.CaptureFixture) -> None:
    """The rows are those of the micro-batch per rank (one virtual rank's at a time); the
    text and the JSON say the layout; ranks that do not divide it are refused."""
    plain = _plan_json(capsys, TOY, '--nproc', '2')
    laid = _plan_json(capsys, TOY, '--nproc', '2', '--cfg-options', 'layout.world_size=8')
    assert {k: laid['layout'][k] for k in ('world_size', 'virtual_ranks_per_rank',
                                           'micro_batches', 'why')} == {
        'world_size': 8, 'virtual_ranks_per_rank': 4, 'micro_batches': 1, 'why': ''}
    assert plain['layout'] is None
    assert [r['micro_batch'] for r in laid['rows']] == [r['micro_batch'] for r in plain['rows']]
    assert main(['plan', TOY, '--nproc', '2', '--cfg-options', 'layout.world_size=8']) == 0
    assert 'layout: the 8-rank run, 4 virtual rank(s) per rank' in capsys.readouterr().out
    assert main(['plan', TOY, '--nproc', '3', '--cfg-options', 'layout.world_size=8']) != 0
    assert 'layout.world_size=8 cannot run on 3 ranks' in capsys.readouterr().err


@pytest.mark.parametrize('config', sorted(glob.glob(osp.join(ROOT, 'configs', '*.py'))))
def test_every_shipped_config_plans(config: str, capsys: pytest.CaptureFixture) -> None:
    plan = _plan_json(capsys, config, '--nproc', '2')
    assert len(plan['rows']) == 8 and plan['recommended'] is not None


def test_bad_input_is_one_line_naming_it(capsys: pytest.CaptureFixture) -> None:
    assert main(['plan', 'no/such/config.py']) == 2
    assert 'no/such/config.py' in capsys.readouterr().err
    assert main(['plan', TOY, '--nproc', '0']) == 2
    assert '--nproc 0' in capsys.readouterr().err


@MODELS.register_module()
class PlanBrokenModel(ToyModel):
    """A model whose own code fails whatever the device."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        raise RuntimeError('the checkpoint of the teacher is missing')


def test_a_model_that_cannot_be_built_is_one_line_naming_the_call(
        tmp_path: Any, capsys: pytest.CaptureFixture) -> None:
    config = osp.join(str(tmp_path), 'broken.py')
    with open(config, 'w') as f:
        f.write(f"_base_ = {TOY!r}\nds_config = {osp.join(osp.dirname(TOY), 'toy_ds.json')!r}\n"
                "model = dict(_delete_=True, type='PlanBrokenModel')\n")
    assert main(['plan', config]) == 2
    err = capsys.readouterr().err
    assert 'Traceback' not in err and len(err.strip().splitlines()) == 1
    assert 'test_plan_planner.py:' in err and 'the checkpoint of the teacher is missing' in err


def _engine(params: int = 10_000_000) -> EngineCensus:
    return EngineCensus('model', '', [params // 10] * 10, params, {'float32': params},
                        params // 10, 'AdamW', 2)


def _layout(stage: int, **changes: object) -> MemoryLayout:
    values = dict(stage=stage, offload_optimizer=False, offload_param=False, compute_bytes=4,
                  ranks=2, micro_batch=1, cuda=False)
    values.update(changes)
    return MemoryLayout(**values)  # type: ignore[arg-type]


def test_model_states_divide_by_the_ranks_as_zero_partitions_them() -> None:
    phi = 10_000_000
    held = {s: engine_bytes(_engine(phi), _layout(s), {}).held for s in range(4)}
    assert held[0] == 12 * phi  # fp32 parameters (stepped in place) and Adam's two moments
    assert held[1] == held[2] == 4 * phi + (4 + 8) * phi / 2  # + an fp32 master partition
    assert held[3] == (4 + 4 + 8 + 4) * phi / 2  # parameters and gradients partitioned too
    bf16 = engine_bytes(_engine(phi), _layout(0, compute_bytes=2), {}).held
    assert bf16 == (2 + 4 + 4 + 8) * phi  # DeepSpeed's bf16 optimizer: fp32 master and grads


def test_an_averaged_model_updated_in_the_step_is_gathered_whole_at_zero3_only() -> None:
    phi = 10_000_000
    engine = _engine(phi)
    teacher = EngineCensus(**{**vars(engine), 'averaged': phi // 4})
    for stage in range(4):
        extra = (engine_bytes(teacher, _layout(stage), {}).backward
                 - engine_bytes(engine, _layout(stage), {}).backward)
        assert extra == (2 * 4 * phi // 4 if stage == 3 else 0)


def test_offload_moves_optimizer_states_and_parameters_to_the_host() -> None:
    phi = 10_000_000
    plain = engine_bytes(_engine(phi), _layout(3), {})
    both = engine_bytes(_engine(phi), _layout(3, offload_optimizer=True, offload_param=True), {})
    assert both.held == pytest.approx(4 * phi / 2)  # the gradient partition stays
    # parameters, master, moments and a pinned fp32 gradient partition
    assert both.host == pytest.approx((4 + 4 + 8 + 4) * phi / 2)
    assert plain.host == 0


def test_an_untouched_bucket_counts_on_cuda_not_in_cpu_rss() -> None:
    """ZeRO-2 allocates reduce_bucket_size elements; on the CPU only written pages are
    resident (a CUDA-only branch: no device here, the layout says cuda)."""
    small = _engine(1_000_000)
    cpu = engine_bytes(small, _layout(2), {'reduce_bucket_size': 500_000_000})
    cuda = engine_bytes(small, _layout(2, cuda=True), {'reduce_bucket_size': 500_000_000})
    assert cuda.backward - cpu.backward == pytest.approx(4 * (500_000_000 - 1_000_000))


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_a_bucket_counts_whole_in_cpu_rss_under_deterministic_mode(stage: int) -> None:
    """torch's deterministic mode fills every torch.empty, so the whole bucket is written
    and resident (issue 43: the plan was 2.5x under at ZeRO-1/2 with `deterministic`)."""
    small = _engine(1_000_000)
    zero = {'reduce_bucket_size': 500_000_000}
    plain = engine_bytes(small, _layout(stage), zero)
    filled = engine_bytes(small, _layout(stage, filled=True), zero)
    cuda = engine_bytes(small, _layout(stage, cuda=True), zero)
    assert filled.backward == cuda.backward > plain.backward


def test_deterministic_configs_fill_empty_tensors() -> None:
    from mmengine.config import Config

    from mmengine_deepspeed.plan.memory import fills_empty
    assert fills_empty(Config(dict(randomness=dict(seed=0, deterministic=True))))
    assert not fills_empty(Config(dict(randomness=dict(seed=0))))
    assert not fills_empty(Config({}))


def test_activations_scale_with_micro_batch_and_dtype() -> None:
    acts = Activations(float_bytes=4000, other_bytes=100, float_size=4, micro_batch=4,
                       method='traced')
    assert acts.bytes_at(8, 4) == 2 * 4100
    assert acts.bytes_at(4, 2) == 2100


def test_construction_is_whole_or_a_partition_plus_the_largest_layer() -> None:
    """The bound measured cold (RESULTS.md section 4): half the model on 2 ranks + the
    largest layer whole + a fixed cost; whole without zero.Init."""
    from mmengine_deepspeed.plan.planner import ZERO_INIT_FIXED_MIB, construction_mib

    engine = _engine(100 * 2**20)  # 400 MiB in fp32, largest layer 40 MiB
    assert construction_mib([engine], 0, 2, False, 300.0) == 300 + 400
    assert construction_mib([engine], 3, 2, False, 300.0, zero_init=False) == 300 + 400
    assert construction_mib([engine], 3, 2, False, 300.0) == 300 + 200 + 40 + ZERO_INIT_FIXED_MIB
    assert construction_mib([engine], 3, 2, True, 0.0) == 200 + 40


def test_a_rows_parts_add_up_to_its_peak_and_name_what_costs_more(demo_plan: dict) -> None:
    """Issue 43: where a row costs more than ZeRO-0 the table says why in a word, and the
    largest micro-batch follows from the same figures (its slope, MiB per sample)."""
    from mmengine_deepspeed.plan.planner import PARTS, why_more
    rows = demo_plan['rows']
    assert rows[0]['why'] == ''  # the reference
    for row in rows[1:]:
        assert (row['why'] in PARTS) == (row['peak_mib'] > rows[0]['peak_mib'] + 0.5), row
        assert row['mib_per_sample'] > 0
    budget = 8 * 1024
    for row in rows:  # the peak grows by its slope: the largest micro-batch is where it crosses
        room = (budget - row['peak_mib']) / row['mib_per_sample']
        assert abs(row['max_micro_batch'] - (row['micro_batch'] + room)) <= 0.02 * room + 2, row
    zero = dict.fromkeys(PARTS, 1.0)
    assert why_more(dict(zero, buffers=30.0), zero) == 'buffers'
    assert why_more(dict(zero, states=0.0, heap=1.2), zero) == ''


def test_a_layout_split_is_planned_at_its_micro_batch(capsys: pytest.CaptureFixture) -> None:
    """``layout.micro_batches``: the rows are planned at the split's micro-batch; ``'auto'``
    takes the smallest split whose predicted peak fits ``memory_gib``, says why, and
    refuses where even one sample does not fit."""
    options = ['--nproc', '2', '--cfg-options', 'train_dataloader.batch_size=256',
               'layout.world_size=4']
    whole = _plan_json(capsys, DEMO, *options)
    halves = _plan_json(capsys, DEMO, *options, 'layout.micro_batches=2')
    assert [r['micro_batch'] for r in halves['rows']] == [128] * len(whole['rows'])
    assert halves['layout']['micro_batches'] == 2
    assert halves['layout']['peak_mib'] < whole['layout']['peak_mib']
    between = (whole['layout']['peak_mib'] + halves['layout']['peak_mib']) / 2 / 1024
    auto = _plan_json(capsys, DEMO, *options, 'layout.micro_batches=auto',
                      f'layout.memory_gib={between}')
    assert auto['layout']['micro_batches'] == 2 and auto['rows'][0]['micro_batch'] == 128
    assert "micro_batches='auto'" in auto['layout']['why'] and 'over' in auto['layout']['why']
    roomy = _plan_json(capsys, DEMO, *options, 'layout.micro_batches=auto',
                       'layout.memory_gib=1000')
    assert roomy['layout']['micro_batches'] == 1 and 'within' in roomy['layout']['why']
    capsys.readouterr()
    assert main(['plan', DEMO, *options, 'layout.micro_batches=auto',
                 'layout.memory_gib=0.001']) == 2
    assert 'even one sample is predicted' in capsys.readouterr().err
    assert main(['plan', DEMO, *options, 'layout.micro_batches=3']) == 2
    assert re.search(r'micro_batches=3 does not divide.*1, 2, 4, 8', capsys.readouterr().err)
    assert main(['plan', DEMO, *options, 'layout.micro_batches=2']) == 0
    assert 'each one\'s batch in 2 micro-batches' in capsys.readouterr().out
