"""CUDA-only checks (fp16 loss scaling, nccl, FusedAdam); skipped without a GPU.

Run on a machine with CUDA: ``pytest tests/gpu``. They are not counted as CPU
coverage: the fp16 logging branch is also unit-tested with a test double in
tests/unit/test_components.py.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')]


def _train(tmp_path: Any, ds_config: dict, optimizer: dict, **extra: Any) -> Any:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed  # noqa: F401
    from tests.helpers import toy_config

    cfg = toy_config(str(tmp_path), ds_config=ds_config, optimizer=optimizer, **extra)
    cfg.update(runner_type='DeepSpeedRunner', env_cfg=dict(dist_cfg=dict(backend='nccl')))
    runner = RUNNERS.build(Config(cfg))
    runner.train()
    return runner


def test_fp16_trains_and_logs_loss_scale(tmp_path: Any) -> None:
    runner = _train(tmp_path, {'zero_optimization': {'stage': 2}, 'fp16': {'enabled': True}},
                    {'type': 'SGD', 'lr': 0.1})
    hub = runner.message_hub
    assert torch.distributed.get_backend() == 'nccl'
    assert next(runner.model.module.parameters()).dtype == torch.float16
    assert hub.get_scalar('train/loss_scale').current() > 0
    assert 'train/skipped_steps' in hub.log_scalars


def test_fused_adam_by_name(tmp_path: Any) -> None:
    runner = _train(tmp_path / 'fused', {'zero_optimization': {'stage': 3},
                                         'bf16': {'enabled': True}},
                    {'type': 'FusedAdam', 'lr': 1e-3})
    assert type(runner.optim_wrapper.optimizer).__name__ == 'FusedAdam'


def test_deepcompile_at_zero3_trains_as_eager(tmp_path: Any) -> None:
    """MMEngine's compile key with ``ds_config.compile.deepcompile``: each engine compiled by
    DeepSpeed's DeepCompile (ZeRO-3's gathers inside the graph, no per-module hooks), the
    parameters within fp32 tolerance of the eager run's."""
    from mmengine_deepspeed.zero.gather import whole_copy
    from tests.helpers import model_state

    ds_config = {'zero_optimization': {'stage': 3}}
    eager = _train(tmp_path / 'eager', ds_config, {'type': 'SGD', 'lr': 0.1})
    expected = model_state(whole_copy(eager.model.module))
    compiled = _train(tmp_path / 'deepcompile', dict(ds_config, compile={'deepcompile': True}),
                      {'type': 'SGD', 'lr': 0.1}, compile=True)
    assert all(spec.engine.is_deepcompile_active() for spec in compiled.strategy.specs)
    for key, value in model_state(whole_copy(compiled.model.module)).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(('command', 'fragments'), [
    ('benchmarks/overhead.py', ('runner MFU', 'on NVIDIA')),
    ('benchmarks/memory.py', ('CUDA allocator peak',)),
])
def test_benchmarks_run_on_cuda(command: str, fragments: tuple[str, ...]) -> None:
    """The benchmarks' CUDA mode (NCCL, one rank per GPU, MFU, allocator figures), smoke size."""
    import sys

    from tests.helpers import run_command

    proc = run_command([sys.executable, *command.split(), '--smoke'], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for fragment in fragments:
        assert fragment in proc.stdout, proc.stdout[-6000:]


def test_preemption_then_exact_resume_with_cuda_randomness(tmp_path: Any) -> None:
    """nccl, one GPU: the model draws dropout masks and noise from the CUDA RNG, the data
    adds noise in 2 DataLoader workers. SIGTERM during iteration 5 makes PreemptionHook save
    ``iter_5.pth`` and leave ``train()`` with status 143; a runner resuming it ends equal to
    an uninterrupted run bit for bit (the CUDA RNG state comes back with the rest)."""
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed  # noqa: F401
    import tests.dist.worker  # noqa: F401  registers SignalHook
    from mmengine_deepspeed.checkpoint.layout import is_complete
    from mmengine_deepspeed.failure import AgreedExit
    from tests.helpers import model_state, recorder, toy_config

    def runner_for(name: str, **extra: Any) -> Any:
        cfg = toy_config(str(tmp_path / name), max_iters=10, model={'type': 'ToyRandomModel'},
                         ds_config={'zero_optimization': {'stage': 2}, 'bf16': {'enabled': True}},
                         dataset_type='ToyRandomDataset', num_workers=2, **extra)
        cfg.update(runner_type='DeepSpeedRunner', experiment_name=name,
                   env_cfg=dict(dist_cfg=dict(backend='nccl')))
        return RUNNERS.build(Config(cfg))

    straight = runner_for('straight')
    straight.train()
    expected = model_state(straight.model.module)
    hooks = [{'type': 'RecorderHook'}, {'type': 'SignalHook', 'at_iter': 5, 'rank': 0}]
    stopped = runner_for('stopped', custom_hooks=hooks)
    with pytest.raises(AgreedExit) as exit_info:
        stopped.train()
    assert exit_info.value.code == 143
    assert is_complete(str(tmp_path / 'stopped' / 'iter_5.pth'))
    resumed = runner_for('resumed', resume=True, load_from=str(tmp_path / 'stopped' / 'iter_5.pth'))
    resumed.train()
    assert recorder(resumed).losses == recorder(straight).losses[5:]
    for key, value in model_state(resumed.model.module).items():
        assert torch.equal(value, expected[key]), key


def test_a_real_cuda_out_of_memory_error_is_retried_split(tmp_path: Any) -> None:
    """``layout.micro_batches='auto'`` (a budget that says the batch of 4 fits), ZeRO-1, nccl,
    one GPU: the model's forward takes 60 % of the GPU's free memory per sample for a
    moment, so the batch of 4 runs out of CUDA memory for real (the CPU tests raise the
    error with a test double); the iteration runs again in 2 micro-batches of 2, which also
    run out, then in 4 of 1, and the run trains on with that split. The caching allocator's
    blocks of the failed attempts are released in between."""
    from mmengine.config import Config
    from mmengine.registry import MODELS, RUNNERS

    import mmengine_deepspeed  # noqa: F401
    from tests.helpers import ToyModel, toy_config

    @MODELS.register_module(force=True)
    class MemoryHungryToy(ToyModel):
        """ToyModel whose training forward allocates 60 % of the free memory per sample."""

        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self.per_sample = int(torch.cuda.mem_get_info()[0] * 0.6) // 4

        def forward(self, inputs: torch.Tensor, labels: Any = None, mode: str = 'tensor') -> Any:
            if mode == 'loss' and inputs.is_cuda:
                torch.empty(len(inputs) * self.per_sample, device=inputs.device)  # and freed
            return super().forward(inputs, labels, mode)

    cfg = toy_config(str(tmp_path), max_iters=4, model={'type': 'MemoryHungryToy',
                                                        'with_bn': False},
                     ds_config={'zero_optimization': {'stage': 1}},
                     layout={'world_size': 1, 'micro_batches': 'auto', 'memory_gib': 1000})
    cfg.update(runner_type='DeepSpeedRunner', env_cfg=dict(dist_cfg=dict(backend='nccl')),
               log_level='INFO')
    runner = RUNNERS.build(Config(cfg))
    runner.train()
    virtual = runner.strategy.virtual_ranks
    assert virtual is not None and virtual.split == 4
    assert runner.strategy.engines()['model'].train_micro_batch_size_per_gpu() == 1
