"""ZeRO-3's reduce bucket on one rank, raw DeepSpeed against DeepSpeedRunner.

Prints ``RAW <n> RUNNER <n> BUCKET <n> TRAINABLE <n>``: the largest live tensor
storage (in elements of 4 bytes) after raw ``deepspeed.initialize`` with
DeepSpeed's default ``reduce_bucket_size``, the same after DeepSpeedRunner
trained the toy model with ZeRO-3, the runner's ``reduce_bucket_size`` and the
toy model's trainable parameter count (ZeRO-3's ``ds_numel``: the full size).
"""
import gc
import sys

import deepspeed
import torch

from mmengine_deepspeed.dist import init_distributed
from tests.helpers import ToyModel, toy_config


def largest_storage_elements() -> int:
    gc.collect()
    sizes = [obj.untyped_storage().nbytes() // 4 for obj in gc.get_objects()
             if isinstance(obj, torch.Tensor) and not obj.is_meta]
    return max(sizes)


def main() -> None:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    init_distributed('none')
    # The runner first: the raw engine's buffers would outlive a `del`.
    cfg = toy_config(sys.argv[1], ds_config={'zero_optimization': {'stage': 3}}, max_iters=2,
                     with_bn=False, val=False)
    runner = RUNNERS.build(Config(dict(cfg, runner_type='DeepSpeedRunner')))
    runner.train()
    ours = largest_storage_elements()
    bucket = runner.engine_specs.shared('zero_optimization.reduce_bucket_size')
    trainable = sum(p.ds_numel for p in runner.model.module.parameters() if p.requires_grad)
    model = ToyModel(with_bn=False)
    deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={'train_micro_batch_size_per_gpu': 4, 'zero_optimization': {'stage': 3},
                'steps_per_print': None, 'zero_allow_untested_optimizer': True})
    print('RAW', largest_storage_elements(), 'RUNNER', ours, 'BUCKET', bucket, 'TRAINABLE',
          trainable)


if __name__ == '__main__':
    main()
