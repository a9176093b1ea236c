"""One-process checks of the runner's helpers, the wrappers and dist setup."""
from __future__ import annotations

import copy
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist
from mmengine.logging import MessageHub
from mmengine.structures import BaseDataElement
from torch import nn

from mmengine_deepspeed import DeepSpeedOptimWrapper, DeepSpeedRunner, DsConfigError
from mmengine_deepspeed.dist import _launcher_env, choose_backend, init_distributed
from mmengine_deepspeed.engine import cast_floating, overrides
from mmengine_deepspeed.engines import mmengine_sides
from mmengine_deepspeed.model_settings import fit_reduce_bucket, match_norm_buffers
from tests.helpers import ToyCustomStepModel, ToyModel, toy_config

# --- the runner refuses bad input before any process work -------------------


def test_bad_ds_config_fails_before_any_process_work(tmp_path: Any) -> None:
    work_dir = tmp_path / 'never_created'
    cfg = toy_config(str(work_dir), ds_config={'zero_optimisation': {'stage': 3}})
    with pytest.raises(DsConfigError, match="Did you mean 'zero_optimization'"):
        DeepSpeedRunner(**cfg)
    assert not work_dir.exists()
    assert not torch_dist.is_initialized()


def test_runner_reads_ds_config_from_cfg(tmp_path: Any) -> None:
    """``from_cfg`` passes ``cfg``; the runner takes ``cfg.ds_config`` from there."""
    cfg = toy_config(str(tmp_path / 'w'), ds_config={'bf17': {'enabled': True}})
    ds_config = cfg.pop('ds_config')
    with pytest.raises(DsConfigError, match="unknown key 'bf17'"):
        DeepSpeedRunner(**cfg, cfg=dict(cfg, ds_config=ds_config))


def test_amp_optim_wrapper_is_refused_early(tmp_path: Any) -> None:
    cfg = toy_config(str(tmp_path / 'w'), ds_config={})
    cfg['optim_wrapper']['type'] = 'AmpOptimWrapper'
    with pytest.raises(DsConfigError, match='bf16=dict'):
        DeepSpeedRunner(**cfg)


def test_side_from_config_dicts() -> None:
    side, = mmengine_sides(dict(batch_size=6), dict(type='OptimWrapper', accumulative_counts=2,
                                                    clip_grad=dict(max_norm=3.0),
                                                    optimizer=dict(type='SGD', lr=0.1)),
                           [{}]).values()
    assert (side.batch_size, side.accumulative_counts, side.clip_grad['max_norm'],
            side.optim_wrapper_type, side.has_optim_wrapper,
            side.has_param_scheduler) == (6, 2, 3.0, 'OptimWrapper', True, True)


def test_side_from_built_objects() -> None:
    from mmengine.optim import OptimWrapper
    from torch.utils.data import DataLoader

    model = nn.Linear(2, 2)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3,
                           clip_grad=dict(type='value', clip_value=1.0))
    side = mmengine_sides(DataLoader(list(range(8)), batch_size=5), wrapper, None)['model']
    assert (side.batch_size, side.accumulative_counts, side.clip_grad['type'],
            side.has_param_scheduler) == (5, 3, 'value', False)


# --- mixed precision and BatchNorm buffers ----------------------------------------

def test_bf16_with_batchnorm_casts_buffers() -> None:
    ds: dict = {'bf16': {'enabled': True}}
    match_norm_buffers(ds, ToyModel(with_bn=True))
    assert ds['data_types'] == {'buffer_dtype': 'bf16'}


def test_buffer_dtype_left_alone_without_norm_or_when_set() -> None:
    ds: dict = {'bf16': {'enabled': True}}
    match_norm_buffers(ds, ToyModel(with_bn=False))
    assert 'data_types' not in ds
    ds = {'bf16': {'enabled': True}, 'data_types': {'buffer_dtype': 'fp32'}}
    match_norm_buffers(ds, ToyModel(with_bn=True))
    assert ds['data_types']['buffer_dtype'] == 'fp32'
    ds = {}
    match_norm_buffers(ds, ToyModel(with_bn=True))
    assert ds == {}


# --- ZeRO-3's reduce bucket ------------------------------------------------------

def test_zero3_reduce_bucket_fits_the_trainable_parameters() -> None:
    """DeepSpeed's 5e8-element default would be allocated whole; a frozen part holds no grads."""
    model = ToyModel(with_bn=False)
    next(model.parameters()).requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ds: dict = {'zero_optimization': {'stage': 3}}
    fit_reduce_bucket(ds, model)
    assert ds['zero_optimization']['reduce_bucket_size'] == trainable
    assert 0 < trainable < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('ds', [
    {'zero_optimization': {'stage': 3, 'reduce_bucket_size': 123}},  # the user's choice
    {'zero_optimization': {'stage': 2}},  # ZeRO-1/2 allocate no bucket up front
    {},
])
def test_reduce_bucket_left_alone_when_set_or_not_zero3(ds: dict) -> None:
    before = copy.deepcopy(ds)
    fit_reduce_bucket(ds, ToyModel(with_bn=False))
    assert ds == before


def test_cast_floating_walks_containers_and_spares_data_samples() -> None:
    Pair = namedtuple('Pair', 'a b')
    sample = BaseDataElement(score=torch.ones(2))
    data = {'inputs': torch.ones(2), 'idx': torch.arange(3),
            'nested': [torch.zeros(1), (torch.ones(1),)], 'pair': Pair(torch.ones(1), 3),
            'data_samples': [sample]}
    out = cast_floating(data, torch.bfloat16)
    assert out['inputs'].dtype == torch.bfloat16
    assert out['idx'].dtype == torch.int64
    assert out['nested'][0].dtype == torch.bfloat16
    assert out['nested'][1][0].dtype == torch.bfloat16
    assert isinstance(out['pair'], Pair) and out['pair'].a.dtype == torch.bfloat16
    assert out['data_samples'][0] is sample and sample.score.dtype == torch.float32


def test_overridden_steps_are_detected() -> None:
    assert not overrides(ToyModel(), 'train_step')
    assert overrides(ToyCustomStepModel(), 'train_step')
    assert not overrides(ToyCustomStepModel(), 'val_step')
    assert overrides(nn.Linear(1, 1), 'train_step')


# --- fp16 logging (no CUDA here) ---------------------------------------------

class _Fp16EngineDouble:
    """Stands in for a CUDA fp16 DeepSpeed engine, which this machine cannot build."""

    def __init__(self) -> None:
        self.optimizer = type('Opt', (), {'loss_scale': 1024.0})()
        self.skipped_steps = 2
        self.boundaries: list[bool] = []
        self.steps = 0

    def set_gradient_accumulation_boundary(self, value: bool) -> None:
        self.boundaries.append(value)

    def backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> None:
        assert scale_wrt_gas is False
        loss.backward(retain_graph=retain_graph)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundaries[-1]

    def step(self) -> None:
        self.steps += 1

    def get_global_grad_norm(self) -> float:
        return 0.75

    def fp16_enabled(self) -> bool:
        return True


def test_fp16_loss_scale_and_skipped_steps_reach_the_message_hub() -> None:
    """A test double replaces the engine: fp16 needs CUDA, which this machine lacks."""
    MessageHub.get_instance('fp16_test')
    param = nn.Parameter(torch.ones(2))
    engine = _Fp16EngineDouble()
    wrapper = DeepSpeedOptimWrapper(engine, torch.optim.SGD([param], lr=0.1),  # type: ignore
                                    accumulative_counts=2)
    wrapper.message_hub = MessageHub.get_instance('fp16_test')
    for _ in range(2):
        wrapper.update_params((param * 2).sum())
    assert engine.boundaries == [False, True]  # MMEngine's accumulation windows
    assert engine.steps == 2  # the engine is stepped after every backward
    assert torch.equal(param.grad, torch.full((2,), 2.0))  # each loss divided by 2
    hub = wrapper.message_hub
    assert hub.get_scalar('train/loss_scale').current() == 1024.0
    assert hub.get_scalar('train/skipped_steps').current() == 2.0
    assert hub.get_scalar('train/grad_norm').current() == 0.75


def test_partial_optimizer_state_is_not_handed_out() -> None:
    wrapper = DeepSpeedOptimWrapper(_Fp16EngineDouble(),  # type: ignore
                                    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(RuntimeError, match=r"one rank's partition"):
        wrapper.state_dict()
    with pytest.raises(RuntimeError, match='resume the runner'):
        wrapper.load_state_dict({})


def test_zero_kwargs_are_refused() -> None:
    wrapper = DeepSpeedOptimWrapper(_Fp16EngineDouble(),  # type: ignore
                                    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(ValueError, match='zero_kwargs'):
        wrapper.update_params(torch.ones(1, requires_grad=True).sum(), zero_kwargs={'x': 1})


# --- dist -----------------------------------------------------------------------------

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


# --- ThroughputHook --------------------------------------------------------------


class _ThroughputRunner:
    """What ThroughputHook reads of a runner, without a process group."""

    def __init__(self, hooks: list) -> None:
        self.hooks = hooks
        self.iter = 0
        self.world_size = 1
        self.ds_config = {'train_micro_batch_size_per_gpu': 4}
        self.model = type('Wrapped', (), {'module': type('M', (), {'tokens_per_sample': 16})()})()
        self.message_hub = MessageHub.get_instance('throughput_hook_test')


@pytest.mark.parametrize(('hooks', 'interval', 'reduced_at'), [
    ([], None, [0, 9, 19]),
    (['logger5'], None, [0, 4, 9, 14, 19]),
    (['logger5'], 7, [0, 6, 13]),
])
def test_throughput_hook_measures_peak_memory_when_logged(hooks: list, interval: Any,
                                                          reduced_at: list) -> None:
    """The peak memory (an all-reduce on several ranks) is measured only on the
    iterations whose log line prints it: LoggerHook's interval unless given."""
    from mmengine.hooks import LoggerHook

    from mmengine_deepspeed.monitor import ThroughputHook

    runner = _ThroughputRunner([LoggerHook(interval=5) for _ in hooks])
    hook = ThroughputHook(interval=interval)
    hook.before_train(runner)
    measured = []
    for it in range(20):
        runner.iter = it
        before = runner.message_hub.log_scalars.get('train/peak_mem_mb')
        count = before.data[1].sum() if before is not None else 0
        hook.after_train_iter(runner, it)
        after = runner.message_hub.log_scalars['train/peak_mem_mb'].data[1].sum()
        if after > count:
            measured.append(it)
    assert measured == reduced_at
    assert runner.message_hub.get_scalar('train/tokens_per_s').current() > 0
    with pytest.raises(ValueError, match='interval=0'):
        ThroughputHook(interval=0)


def test_find_unused_parameters_gradients_arrive_in_one_order_whatever_was_used() -> None:
    """DeepSpeed reduces gradients in the order they arrive: the surrogate makes that order
    depend on the parameter list only, gives skipped parameters zeros and carries the scale
    DeepSpeed puts on the loss (the fp16 loss scale) exactly."""
    from mmengine_deepspeed.unused import reached_parameters, with_every_parameter

    def run(use_head: bool) -> tuple[list[int], list[torch.Tensor]]:
        torch.manual_seed(0)
        body, head = nn.Linear(3, 3), nn.Linear(3, 3)
        params = [*body.parameters(), *head.parameters()]
        order: list[int] = []
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(lambda p, i=index: order.append(i))
        out = body(torch.ones(2, 3))
        loss = (head(out) if use_head else out).sum()
        assert (id(params[2]) in reached_parameters(loss)) is use_head
        (with_every_parameter(loss, params, retain_graph=False) * 1024.0).backward()
        return order, [p.grad.clone() for p in params]

    used_order, _ = run(True)
    skipped_order, skipped_grads = run(False)
    assert used_order == skipped_order
    assert not skipped_grads[2].any() and not skipped_grads[3].any()
    torch.manual_seed(0)
    body = nn.Linear(3, 3)
    (body(torch.ones(2, 3)).sum() * 1024.0).backward()
    assert torch.equal(skipped_grads[0], body.weight.grad)


def test_emulated_bf16_is_named_with_its_cost_and_the_fix(monkeypatch: Any) -> None:
    """The CPU probe is replaced: this machine's CPU may compute bf16 natively."""
    import mmengine_deepspeed.monitor as monitor

    monkeypatch.setattr(monitor, 'native_bf16', lambda: False)
    note = monitor.precision_note(True, 'bf16', on_cuda=False)
    assert note is not None and 'emulated' in note and '"auto"' in note and 'slower' in note
    assert 'training in fp32' in str(monitor.precision_note('auto', 'fp32', on_cuda=False))
    assert monitor.precision_note(False, 'fp32', on_cuda=False) is None
    assert monitor.precision_note(True, 'bf16', on_cuda=True) is None
    monkeypatch.setattr(monitor, 'native_bf16', lambda: True)
    assert monitor.precision_note(True, 'bf16', on_cuda=False) is None


def test_train_cfg_with_type_and_by_epoch_is_refused_as_mmengine_does(tmp_path: Any) -> None:
    runner = DeepSpeedRunner(**toy_config(str(tmp_path)))
    with pytest.raises(RuntimeError, match='Only one of `type` or `by_epoch`'):
        runner.build_train_loop(dict(type='EpochBasedTrainLoop', by_epoch=True, max_epochs=1))
