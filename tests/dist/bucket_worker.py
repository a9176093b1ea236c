"""The reduce bucket on one rank, raw DeepSpeed against DeepSpeedRunner.

``bucket_worker.py WORK_DIR 3`` prints ``RAW <n> RUNNER <n> BUCKET <n> TRAINABLE <n>``:
the largest live tensor storage (in elements of 4 bytes) after raw
``deepspeed.initialize`` with DeepSpeed's default ``reduce_bucket_size`` (ZeRO-3
allocates it up front), the same after DeepSpeedRunner trained the toy model with
ZeRO-3, the runner's ``reduce_bucket_size`` and the toy model's trainable parameter
count (ZeRO-3's ``ds_numel``: the full size).

``bucket_worker.py WORK_DIR 2`` does the same at ZeRO-2 under torch's deterministic
mode (MMEngine's ``randomness.deterministic``), where the bucket is allocated at every
backward and ``torch.empty`` is filled, so it is resident whole: ``RAW`` and
``RUNNER`` are then the peak RSS (MiB) after the runner's training and after one raw
backward.
"""
import gc
import sys

import deepspeed
import torch

from mmengine_deepspeed.dist import init_distributed
from mmengine_deepspeed.process_memory import peak_memory_mb
from tests.helpers import IN_FEATURES, NUM_CLASSES, ToyModel, toy_config


def largest_storage_elements() -> int:
    gc.collect()
    sizes = [obj.untyped_storage().nbytes() // 4 for obj in gc.get_objects()
             if isinstance(obj, torch.Tensor) and not obj.is_meta]
    return max(sizes)


def main() -> None:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    init_distributed('none')
    stage = int(sys.argv[2])
    deterministic = stage != 3
    # The runner first: the raw engine's buffers would outlive a `del`.
    cfg = toy_config(sys.argv[1], ds_config={'zero_optimization': {'stage': stage}},
                     max_iters=2, with_bn=False, val=False,
                     randomness=dict(seed=0, deterministic=deterministic))
    runner = RUNNERS.build(Config(dict(cfg, runner_type='DeepSpeedRunner')))
    runner.train()
    ours = peak_memory_mb() if deterministic else largest_storage_elements()
    bucket = runner.strategy.specs.shared('zero_optimization.reduce_bucket_size')
    module = runner.model.module
    trainable = sum(getattr(p, 'ds_numel', p.numel()) for p in module.parameters()
                    if p.requires_grad)
    model = ToyModel(with_bn=False)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={'train_micro_batch_size_per_gpu': 4, 'zero_optimization': {'stage': stage},
                'steps_per_print': None, 'zero_allow_untested_optimizer': True})
    if deterministic:
        inputs, labels = torch.randn(4, IN_FEATURES), torch.randint(NUM_CLASSES, (4,))
        engine.backward(engine(inputs, labels, mode='loss')['loss'])
    raw = peak_memory_mb() if deterministic else largest_storage_elements()
    print('RAW', raw, 'RUNNER', ours, 'BUCKET', bucket, 'TRAINABLE', trainable)


if __name__ == '__main__':
    main()
