"""Pins DeepSpeed #8499 on one rank: under ZeRO-3, ``load_checkpoint(tag='A',
load_optimizer_states=False)`` loads the ``latest`` tag instead of ``A``.

Our ``load_from`` never goes through that call (weights are consolidated and
loaded into the bare model before ``deepspeed.initialize``); this script shows
why. Prints ``LOADED_A <bool> LOADED_B <bool>``.
"""
import sys

import deepspeed
import torch

from mmengine_deepspeed.dist import init_distributed

CONFIG = {'train_micro_batch_size_per_gpu': 1, 'zero_optimization': {'stage': 3},
          'steps_per_print': None}


def make_engine() -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG,
                                      optimizer=torch.optim.Adam(model.parameters(), lr=0.1))
    return engine


def first_weight(engine: deepspeed.DeepSpeedEngine) -> torch.Tensor:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return params[0].detach().clone()


def main() -> None:
    init_distributed('none')
    save_dir = sys.argv[1]
    engine = make_engine()
    engine.save_checkpoint(save_dir, tag='A')
    weight_a = first_weight(engine)
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    engine.save_checkpoint(save_dir, tag='B')  # 'latest' now names B
    weight_b = first_weight(engine)
    fresh = make_engine()
    fresh.load_checkpoint(save_dir, tag='A', load_optimizer_states=False,
                          load_lr_scheduler_states=False)
    loaded = first_weight(fresh)
    print('LOADED_A', torch.equal(loaded, weight_a), 'LOADED_B', torch.equal(loaded, weight_b))


if __name__ == '__main__':
    main()
