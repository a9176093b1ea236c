"""Pins the DeepSpeed 0.19 behaviours ``zero/zero_dim.py`` relies on, on one rank.

Prints one ``NAME RESULT`` line per fact:

* ``RAW_STAGE<S>``: ``deepspeed.initialize`` on a model with a 0-dim parameter
  raises torch's "view Float as Byte" error (the trap), for ZeRO 0-3;
* ``MARKED_STAGE<S>``: with the parameter marked ``ds_optim_param``, ZeRO 0-2
  initialize, and the parameter is still 0-dim after a step;
* ``CLIP_STAGE0``: ZeRO-0 fp32 clipping fails on a 0-dim gradient;
* ``ZERO3_SHAPE``: under ZeRO-3 a parameter partitioned 1-dim and given a
  0-dim ``ds_shape`` afterwards gathers 0-dim.
"""
import deepspeed
import torch
from torch import nn

from mmengine_deepspeed.dist import init_distributed


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def build(stage: int, model: nn.Module,
          gradient_clipping: float = 0.0) -> deepspeed.DeepSpeedEngine:
    config = {'train_micro_batch_size_per_gpu': 1, 'steps_per_print': None,
              'gradient_clipping': gradient_clipping,
              'zero_optimization': {'stage': stage}, 'zero_allow_untested_optimizer': True}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return engine


def main() -> None:
    init_distributed('none')
    for stage in range(4):
        try:
            build(stage, Scaled())
            print(f'RAW_STAGE{stage} initialized', flush=True)
        except RuntimeError as e:
            print(f'RAW_STAGE{stage} {"view_error" if "Byte" in str(e) else e}', flush=True)
    for stage in range(3):
        model = Scaled()
        model.scale.ds_optim_param = True
        engine = build(stage, model)
        del model.scale.ds_optim_param
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
        print(f'MARKED_STAGE{stage} {tuple(model.scale.shape)}', flush=True)
    model = Scaled()
    model.scale.ds_optim_param = True
    engine = build(0, model, gradient_clipping=0.5)
    try:
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
        print('CLIP_STAGE0 stepped', flush=True)
    except RuntimeError as e:
        print(f'CLIP_STAGE0 {"shape_error" if "shape" in str(e) else e}', flush=True)
    model = Scaled()
    model.scale.data = model.scale.data.reshape(1)
    engine = build(3, model)
    model.scale.ds_shape = torch.Size([])
    with deepspeed.zero.GatheredParameters([model.scale]):
        print(f'ZERO3_SHAPE {tuple(model.scale.shape)}', flush=True)


if __name__ == '__main__':
    main()
