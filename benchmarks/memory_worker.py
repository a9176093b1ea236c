"""One rank of the memory benchmark: build a model under a ZeRO stage, take steps,
report peak memory. Usage: ``memory_worker.py STAGE OFFLOAD(0|1) WIDTH DEPTH STEPS``.

On CPU the figures are the peak RSS and the RSS after the steps, each minus the
RSS before the model existed (model states, DeepSpeed's buffers, a small batch's
activations); on CUDA the allocator's peak and current allocation. Rank 0 prints
``RESULT {json}`` with the maximum over ranks.
"""
from __future__ import annotations

import gc
import json
import resource
import sys

import torch
import torch.distributed as dist


def rss_mb() -> float:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    import deepspeed

    from benchmarks.common import RandomTokens  # noqa: F401  registers the dataset
    from mmengine_deepspeed.demo.model import TinyGPT
    from mmengine_deepspeed.dist import init_distributed

    stage, offload, width, depth, steps = map(int, sys.argv[1:6])
    init_distributed('pytorch', dict(backend='nccl' if torch.cuda.is_available() else 'gloo'))
    cuda = torch.cuda.is_available()
    base = rss_mb()
    torch.manual_seed(0)
    model = TinyGPT(block_size=64, width=width, depth=depth, heads=8)
    params = sum(p.numel() for p in model.parameters())
    zero: dict = {'stage': stage}
    if offload:
        zero.update(offload_optimizer={'device': 'cpu'}, offload_param={'device': 'cpu'})
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    config = dict(train_micro_batch_size_per_gpu=1, zero_optimization=zero,
                  steps_per_print=None, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens = torch.randint(256, (1, 65))
    if cuda:
        tokens = tokens.cuda()
    for _ in range(steps):
        loss = engine(tokens[:, :-1], tokens[:, 1:], mode='loss')['loss']
        engine.backward(loss)
        engine.step()
    gc.collect()
    if cuda:
        peak, steady = (torch.cuda.max_memory_allocated() / 2**20,
                        torch.cuda.memory_allocated() / 2**20)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
        steady = rss_mb() - base
    value = torch.tensor([peak, steady], dtype=torch.float64, device='cuda' if cuda else 'cpu')
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print('RESULT ' + json.dumps(dict(stage=stage, offload=bool(offload), params=params,
                                          peak_mb=float(value[0]), steady_mb=float(value[1]),
                                          world=dist.get_world_size(), cuda=cuda)), flush=True)


if __name__ == '__main__':
    main()
