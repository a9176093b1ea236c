"""checkpoint/checkpointer.py and parts.py: save -> restore round trips in one process.

The engines are fakes that write and read their module's state the way DeepSpeed's
``save_checkpoint`` / ``load_checkpoint`` are called (a tag directory per engine): these
tests pin the Checkpointer's own logic (parts under their keys, per-rank files, the
weights-only branch, the plan resolved once, the path agreed, hooks called), which the
2-rank tests reach only through whole training runs. Real DeepSpeed engines are covered by
tests/dist/test_checkpoint.py and test_exact_resume.py.
"""
from __future__ import annotations

import logging
import os
import os.path as osp
from typing import Any, Optional

import pytest
import torch
from mmengine.logging import MessageHub
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.optim.scheduler import LinearLR
from torch import nn

from mmengine_deepspeed import init_distributed
from mmengine_deepspeed.checkpoint.checkpointer import Checkpointer
from mmengine_deepspeed.checkpoint.layout import (
    ITERATOR_STREAMS_KEY,
    META_KEY,
    PARAM_GROUPS_KEY,
    WEIGHTS_FILE,
    CheckpointError,
    engine_tag,
    read_meta,
)
from mmengine_deepspeed.checkpoint.parts import ParamGroupsPart, Part, run_parts
from mmengine_deepspeed.checkpoint.resume_plan import ResumeKind, ResumePlan
from mmengine_deepspeed.config.resolve import MMEngineSettings
from mmengine_deepspeed.engine.spec import SINGLE_ENGINE, EngineSpecs, named_wrappers

LOGGER = logging.getLogger('test_checkpointer')


@pytest.fixture(scope='module', autouse=True)
def one_process_group() -> None:
    """Save and restore are collective; one process makes a world of one."""
    init_distributed('none')


class FakeEngine:
    """What the Checkpointer calls on a DeepSpeed engine, writing the module's state."""

    def __init__(self, module: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        self.module = module
        self.optimizer = optimizer
        self.client_optimizer = optimizer
        self.loaded: list[str] = []

    def save_checkpoint(self, path: str, *, tag: str, save_latest: bool,
                        client_state: dict) -> None:
        os.makedirs(osp.join(path, tag), exist_ok=True)
        torch.save({'module': self.module.state_dict()},
                   osp.join(path, tag, 'mp_rank_00_model_states.pt'))

    def load_checkpoint(self, path: str, *, tag: str, **kwargs: Any) -> tuple[str, dict]:
        state = torch.load(osp.join(path, tag, 'mp_rank_00_model_states.pt'))
        self.module.load_state_dict(state['module'])
        self.loaded.append(tag)
        return path, {}


class Model(nn.Module):
    """A generator and a discriminator (two engines), an EMA copy outside both, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Linear(3, 3)
        self.discriminator = nn.Linear(3, 1)
        self.ema = nn.Linear(3, 3)
        self.register_buffer('steps', torch.zeros(()))


class Loop:
    """The loop attributes the parts read and write."""

    def __init__(self) -> None:
        self._epoch, self._iter = 0, 0
        self.iterator_streams: Optional[dict] = None
        self.skipped = False

    def skip_trained_batches(self) -> None:
        self.skipped = True


class Run:
    """The runner side: what the Checkpointer is attached to."""

    def __init__(self, work_dir: str, several: bool, train: bool = True,
                 load_from: Optional[str] = None):
        self.model = Model()
        names = {'generator': 'generator', 'discriminator': 'discriminator'} if several \
            else {SINGLE_ENGINE: ''}
        settings = {name: MMEngineSettings(batch_size=2, has_optim_wrapper=True)
                    for name in names}
        self.specs = EngineSpecs({'zero_optimization': {'stage': 2}}, None, settings)
        self.specs.resolve(world_size=1)
        self.wrappers = {}
        for name, path in names.items():
            module = self.model.get_submodule(path) if path else self.model
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9) \
                if train else None
            spec = self.specs[name]
            spec.path, spec.optimizer = path, optimizer
            spec.engine = FakeEngine(module, optimizer)  # type: ignore[assignment]
            if optimizer is not None:
                self.wrappers[name] = OptimWrapper(optimizer)
        self.optim_wrapper: Any = (OptimWrapperDict(**self.wrappers) if several
                                   else self.wrappers.get(SINGLE_ENGINE))
        first = next(iter(self.wrappers.values()), None)
        self.schedulers = ([LinearLR(first.optimizer, start_factor=0.5, end=4)]
                           if first is not None else [])
        self.loop = Loop()
        self.hub = MessageHub.get_instance('test_checkpointer')
        self.hooks: list[tuple[str, dict]] = []
        self.checkpointer = Checkpointer(
            work_dir, self.specs, self.model, parts=self.parts, call_hook=self.call_hook,
            resume=False, load_from=load_from, allow_unsafe=False, logger=LOGGER, world_size=1,
            rank=0, seed=7, experiment_name='unit')

    def parts(self, meta: Optional[dict], save_param_scheduler: bool) -> list[Part]:
        return run_parts(  # the runner's list (strategy/checkpoints.checkpoint_parts)
            wrappers=named_wrappers(self.optim_wrapper) if self.wrappers else {},
            model=self.model, modules=self.specs.modules(), loop=self.loop, hub=self.hub,
            schedulers=self.schedulers, schedule='max_iters=8', logger=LOGGER, meta=meta,
            save_param_scheduler=save_param_scheduler)

    def call_hook(self, name: str, checkpoint: dict) -> None:
        self.hooks.append((name, checkpoint))
        if name == 'before_save_checkpoint':
            checkpoint['hook_key'] = 'from a hook'


def _snapshot(run: Run) -> dict[str, Any]:
    return dict(
        weights={k: v.clone() for k, v in run.model.state_dict().items()},
        lrs=[g['lr'] for w in run.wrappers.values() for g in w.optimizer.param_groups],
        scheduler=run.schedulers[0].state_dict() if run.schedulers else None,
        position=(run.loop._epoch, run.loop._iter), streams=run.loop.iterator_streams,
        hub=run.hub.get_info('marker'), draw=torch.rand(3))


def _scramble(run: Run) -> None:
    """Every piece of state the checkpoint holds, changed."""
    with torch.no_grad():
        for value in run.model.state_dict().values():
            value.add_(1.5)
    for wrapper in run.wrappers.values():
        for group in wrapper.optimizer.param_groups:
            group['lr'] = 123.0
    for scheduler in run.schedulers:
        scheduler.step()
    run.loop._epoch, run.loop._iter, run.loop.iterator_streams = 9, 99, {'changed': 1}
    run.hub.update_info('marker', 'changed')
    torch.rand(5)


@pytest.mark.parametrize('several', [False, True], ids=['one engine', 'two engines'])
def test_a_saved_run_comes_back_whole(tmp_path: Any, several: bool) -> None:
    run = Run(str(tmp_path), several)
    with torch.no_grad():
        run.model.steps.fill_(3)
    run.loop._iter, run.loop.iterator_streams = 5, {'torch': [1, 2, 3]}
    run.hub.update_info('marker', 'saved')
    for wrapper in run.wrappers.values():
        wrapper.optimizer.param_groups[0]['lr'] = 0.05
    torch.manual_seed(11)
    path = str(tmp_path / 'iter_5.pth')
    run.checkpointer.save(path, meta={'epoch': 0, 'iter': 5}, weights_only=False)
    saved = _snapshot(run)
    meta = read_meta(path)
    assert (meta['iter'], meta['seed'], meta['experiment_name']) == (5, 7, 'unit')
    assert ('engines' in meta) == several
    assert [name for name, _ in run.hooks] == ['before_save_checkpoint']

    _scramble(run)
    torch.manual_seed(11)
    torch.rand(3)  # the state restore must bring back: the draw after the save's
    client = run.checkpointer.restore(path)
    restored = _snapshot(run)
    for key, value in saved['weights'].items():
        assert torch.equal(restored['weights'][key], value), key
    assert restored['lrs'] == saved['lrs'] == [0.05] * len(run.wrappers)
    assert restored['scheduler'] == saved['scheduler']
    assert restored['position'] == (0, 5) and run.loop.skipped
    assert restored['streams'] == {'torch': [1, 2, 3]}
    assert restored['hub'] == 'saved'
    assert torch.equal(restored['draw'], saved['draw'])  # this rank's RNG streams
    assert client['hook_key'] == 'from a hook' and client[META_KEY]['iter'] == 5
    assert run.hooks[-1] == ('after_load_checkpoint', client)
    assert sorted(tag for e in run.specs.engines().values() for tag in e.loaded) \
        == sorted(engine_tag(name) for name in run.specs.engines())


def test_a_weights_only_checkpoint_restores_weights_and_run_state(tmp_path: Any) -> None:
    """save_optimizer=False: the consolidated weights in place of the engines' shards;
    the loop, groups and schedulers still come back, the engines load nothing."""
    run = Run(str(tmp_path), several=False)
    run.loop._iter = 3
    path = str(tmp_path / 'iter_3.pth')
    run.checkpointer.save(path, meta={'epoch': 0, 'iter': 3}, weights_only=True)
    assert osp.isfile(osp.join(path, WEIGHTS_FILE))
    assert not read_meta(path)['optimizer_state']
    saved = _snapshot(run)
    _scramble(run)
    run.checkpointer.restore(path)
    restored = _snapshot(run)
    for key, value in saved['weights'].items():
        assert torch.equal(restored['weights'][key], value), key
    assert restored['position'] == (0, 3) and restored['lrs'] == saved['lrs']
    assert run.specs[SINGLE_ENGINE].engine.loaded == []  # type: ignore[union-attr]


def test_param_groups_of_format_1_load_into_the_one_engine() -> None:
    """Checkpoints of format 1 saved one optimizer's groups as a list."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    part = ParamGroupsPart({SINGLE_ENGINE: OptimWrapper(optimizer)})
    part.load_state_dict([{'lr': 0.25, 'momentum': 0.0}])
    assert optimizer.param_groups[0]['lr'] == 0.25
    assert ParamGroupsPart({}).state_dict() is None  # before train() built them


def test_parts_that_have_nothing_to_save_save_nothing(tmp_path: Any) -> None:
    run = Run(str(tmp_path), several=False)
    keys = {part.key: part.state_dict() for part in run.parts({'iter': 1}, False)}
    assert keys[PARAM_GROUPS_KEY] is not None
    assert keys['param_schedulers'] is None  # save_param_scheduler=False
    assert keys['outside_engines'] is None  # one engine holds the whole model
    assert keys[ITERATOR_STREAMS_KEY] is None  # no iterator created yet


def test_after_validation_rewrites_only_the_checkpoint_of_that_position(tmp_path: Any) -> None:
    run = Run(str(tmp_path), several=False)
    path = str(tmp_path / 'iter_4.pth')
    run.loop.iterator_streams = {'before': 1}
    run.checkpointer.save(path, meta={'epoch': 0, 'iter': 4}, weights_only=False)
    run.loop.iterator_streams = {'after validation': 1}
    run.checkpointer.after_validation(0, 3)  # another position: nothing written
    run.loop.iterator_streams = None
    run.checkpointer.restore(path)
    assert run.loop.iterator_streams == {'before': 1}
    run.loop.iterator_streams = {'after validation': 1}
    run.checkpointer.after_validation(0, 4)
    run.loop.iterator_streams = None
    run.checkpointer.restore(path)
    assert run.loop.iterator_streams == {'after validation': 1}


def test_the_plan_is_resolved_once_and_again_after_a_resume_request(tmp_path: Any) -> None:
    run = Run(str(tmp_path), several=False)
    assert run.checkpointer.resolve_plan().kind is ResumeKind.NONE
    path = str(tmp_path / 'iter_2.pth')
    run.checkpointer.save(path, meta={'epoch': 0, 'iter': 2}, weights_only=False)
    assert run.checkpointer.resolve_plan().kind is ResumeKind.NONE  # kept
    run.checkpointer.request_resume(path)
    plan = run.checkpointer.resolve_plan()
    assert (plan.kind, plan.path) == (ResumeKind.FULL, path)
    assert run.checkpointer.resolve_plan() is plan


def test_what_is_loaded_when(tmp_path: Any) -> None:
    """``due``, the one place that decides: load_from weights before the engines; a resume
    once they are built (everything into training engines, only the weights into an
    evaluation engine, the rest when training engines are built); nothing twice."""
    path = str(tmp_path / 'iter_2.pth')
    Run(str(tmp_path), several=False).checkpointer.save(
        path, meta={'epoch': 0, 'iter': 2}, weights_only=False)
    weights = Run(str(tmp_path), several=False, load_from='w.pth').checkpointer
    assert weights.due(engines_built=False) == ResumePlan(ResumeKind.WEIGHTS, 'w.pth')
    assert weights.due(engines_built=True) is None
    resumed = Run(str(tmp_path), several=False).checkpointer
    resumed.request_resume(path)
    assert resumed.due(engines_built=False) is None
    assert resumed.due(engines_built=True) == ResumePlan(ResumeKind.FULL, path)
    resumed.restore(path)
    assert resumed.due(engines_built=True) is None
    consolidated = str(tmp_path / 'iter_3.pth')  # weights the fake engines can read back
    Run(str(tmp_path), several=False).checkpointer.save(
        consolidated, meta={'epoch': 0, 'iter': 3}, weights_only=True)
    evaluated = Run(str(tmp_path), several=False, train=False).checkpointer
    evaluated.request_resume(consolidated)
    assert evaluated.due(engines_built=True) == \
        ResumePlan(ResumeKind.WEIGHTS_ONLY, consolidated)
    evaluated.load_weights(consolidated, strict=True, revise_keys=())
    assert evaluated.due(engines_built=True) is None


def test_loading_weights_into_a_training_engine_is_refused(tmp_path: Any) -> None:
    run = Run(str(tmp_path), several=False)
    with pytest.raises(RuntimeError, match=r'fp32 master weights.*load_from'):
        run.checkpointer.load_weights('w.pth', strict=False, revise_keys=())


def test_restoring_other_engines_is_refused_by_name(tmp_path: Any) -> None:
    two = Run(str(tmp_path), several=True)
    path = str(tmp_path / 'iter_1.pth')
    two.checkpointer.save(path, meta={'epoch': 0, 'iter': 1}, weights_only=False)
    with pytest.raises(CheckpointError, match=r"holds the engines .*'generator'.*optim_wrapper"):
        Run(str(tmp_path), several=False).checkpointer.restore(path)

