"""One rank of the memory benchmark: build a model under a ZeRO stage, take steps,
report memory. Usage: ``memory_worker.py STAGE OFFLOAD(0|1) WIDTH DEPTH STEPS BUCKET``.

Three figures per rank, the maximum over ranks printed by rank 0 as ``RESULT {json}``:

* ``peak_mb``: on CPU the peak RSS minus the RSS before the model existed (it
  includes the full model every rank builds before DeepSpeed partitions it); on
  CUDA the allocator's peak.
* ``steady_mb``: the same after the steps. On CPU, glibc's ``malloc_trim`` runs
  first: freed memory that malloc keeps for reuse (the full model ZeRO-3 freed
  after partitioning, the activations) would otherwise count as held.
* ``tensor_mb``: the bytes of every live tensor's storage, each storage once:
  the model states DeepSpeed holds, measured the same way on CPU and CUDA.

``BUCKET`` (elements) is given to ``reduce_bucket_size``, ``allgather_bucket_size``
and ``stage3_prefetch_bucket_size`` for every stage alike: ZeRO-3 allocates a
whole ``reduce_bucket_size`` gradient buffer up front, and DeepSpeed's default
(5e8 elements, 1.9 GiB in fp32) would dwarf the model states measured here.
"""
from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist

from benchmarks.common import live_rss_kib


def live_tensor_mb() -> float:
    """Bytes of all live tensor storages, each counted once (views share one)."""
    gc.collect()
    storages: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()) / 2**20


def main() -> None:
    import deepspeed

    from mmengine_deepspeed.demo.model import TinyGPT
    from mmengine_deepspeed.dist import init_distributed
    from mmengine_deepspeed.process_memory import peak_memory_mb

    stage, offload, width, depth, steps, bucket = map(int, sys.argv[1:7])
    cuda = torch.cuda.is_available()
    init_distributed('pytorch', dict(backend='nccl' if cuda else 'gloo'))
    base = live_rss_kib() / 1024
    torch.manual_seed(0)
    model = TinyGPT(block_size=64, width=width, depth=depth, heads=8)
    params = sum(p.numel() for p in model.parameters())
    zero: dict = dict(stage=stage, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                      stage3_prefetch_bucket_size=bucket)
    if offload:
        zero.update(offload_optimizer={'device': 'cpu'}, offload_param={'device': 'cpu'})
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    config = dict(train_micro_batch_size_per_gpu=1, zero_optimization=zero,
                  steps_per_print=None, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens = torch.randint(256, (1, 65), device=engine.device)
    for _ in range(steps):
        loss = engine(tokens[:, :-1], tokens[:, 1:], mode='loss')['loss']
        engine.backward(loss)
        engine.step()
    del loss
    tensors = live_tensor_mb()
    if cuda:
        peak, steady = peak_memory_mb(), torch.cuda.memory_allocated() / 2**20
    else:
        peak, steady = peak_memory_mb() - base, live_rss_kib() / 1024 - base
    value = torch.tensor([peak, steady, tensors], dtype=torch.float64, device=engine.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print('RESULT ' + json.dumps(dict(
            stage=stage, offload=bool(offload), params=params, peak_mb=float(value[0]),
            steady_mb=float(value[1]), tensor_mb=float(value[2]),
            world=dist.get_world_size(), cuda=cuda)), flush=True)


if __name__ == '__main__':
    main()
