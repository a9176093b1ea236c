"""plan/transients.py: the broadcast operands of batched matmuls, and the CPU copies them.

The CPU tests pin the torch behaviour the planner relies on, on whatever CPU runs them:
a 16-bit ``bmm`` copies an operand broadcast over its batch exactly where
``compat.onednn_bf16_matmul`` says oneDNN takes it (never with mkldnn disabled), and the
fp32 kernel never does.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import MODELS
from torch import nn
from torch.profiler import ProfilerActivity, profile

from mmengine_deepspeed.compat import onednn_bf16_matmul
from mmengine_deepspeed.plan.activations import Activations
from mmengine_deepspeed.plan.planner import make_plan
from mmengine_deepspeed.plan.transients import BroadcastOperands, copies_broadcast
from tests.helpers import IN_FEATURES, NUM_CLASSES

LENGTH, WIDTH = 16, 32


@MODELS.register_module()
class FrozenAttention(BaseModel):
    """A frozen ``nn.MultiheadAttention(batch_first=True)`` between two trained layers."""

    def __init__(self, data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.embed = nn.Linear(IN_FEATURES, LENGTH * WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.attention.requires_grad_(False)
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        x = self.embed(inputs).view(len(inputs), LENGTH, WIDTH)
        x, _ = self.attention(x, x, x, need_weights=False)
        logits = self.head(x.mean(1))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits, labels))
        return logits


def _broadcast(weight_grad: bool, contiguous: bool) -> int:
    weight = torch.randn(3 * WIDTH, WIDTH, device='meta', requires_grad=weight_grad)
    x = torch.randn(LENGTH, 4, WIDTH, device='meta')
    x = x.contiguous() if contiguous else x.transpose(0, 1)
    with BroadcastOperands() as mode:
        nn.functional.linear(x, weight)
    return mode.largest


def test_a_frozen_weight_against_a_strided_input_is_read_broadcast_on_meta() -> None:
    # matmul expands the weight over the input's leading dimension and calls bmm
    assert _broadcast(weight_grad=False, contiguous=False) == 4 * 3 * WIDTH * WIDTH
    # a weight that needs its gradient, or a contiguous input: one folded matrix product
    assert _broadcast(weight_grad=True, contiguous=False) == 0
    assert _broadcast(weight_grad=False, contiguous=True) == 0


def _allocated_by_bmm(dtype: torch.dtype) -> int:
    batch, rows, cols = 8, 256, 256
    x = torch.randn(batch, 4, rows, dtype=dtype)
    weight = torch.randn(rows, cols, dtype=dtype).expand(batch, rows, cols)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.bmm(x, weight)
    return sum(max(0, event.self_cpu_memory_usage) for event in prof.key_averages())


@pytest.mark.filterwarnings('ignore:TF32 acceleration')  # what mkldnn.flags() says on a CPU
@pytest.mark.parametrize('mkldnn', [True, False])
def test_the_cpu_bf16_bmm_copies_a_broadcast_operand_where_onednn_takes_it(
        mkldnn: bool) -> None:
    copy = 8 * 256 * 256 * 2
    with torch.backends.mkldnn.flags(enabled=mkldnn):
        copies = copies_broadcast(cuda=False, element_size=2)
        assert (_allocated_by_bmm(torch.bfloat16) >= copy) == copies
        assert _allocated_by_bmm(torch.float32) < 8 * 256 * 256 * 4 / 2
        assert not copies_broadcast(cuda=False, element_size=4)
    assert copies == (mkldnn and onednn_bf16_matmul())


def test_the_transient_counts_where_the_cpu_copies_and_never_shrinks() -> None:
    acts = Activations(1000, 0, 4, 4, 'traced', None, broadcast=100)
    copies = copies_broadcast(cuda=False, element_size=2)
    assert acts.transient_at(4, 2, cuda=False) == (200 if copies else 0)
    assert acts.transient_at(8, 2, cuda=False) == (400 if copies else 0)  # scaled up
    assert acts.transient_at(2, 2, cuda=False) == (200 if copies else 0)  # never down
    assert acts.transient_at(4, 4, cuda=False) == 0
    assert acts.transient_at(4, 2, cuda=True) == 0


def _plan(precision: str) -> Any:
    return make_plan(Config(dict(
        model=dict(type='FrozenAttention', data_preprocessor=dict(type='ToyPreprocessor')),
        ds_config=dict(bf16=dict(enabled=precision == 'bf16')),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
        train_dataloader=dict(batch_size=4, num_workers=0, dataset=dict(type='ToyDataset', size=8),
                              sampler=dict(type='DefaultSampler', shuffle=False),
                              collate_fn=dict(type='default_collate')))), nproc=2)


def test_plan_counts_the_copy_in_bf16_on_the_cpu_and_says_so() -> None:
    bf16, fp32 = _plan('bf16'), _plan('fp32')
    copy_mib = LENGTH * 3 * WIDTH * WIDTH * 2 / 2**20
    assert bf16.activations.broadcast == fp32.activations.broadcast == LENGTH * 3 * WIDTH ** 2
    if not copies_broadcast(cuda=False, element_size=2):  # this CPU's bf16 bmm copies nothing
        assert bf16.as_json()['activations']['transient_mib'] == 0 and not bf16.notes
        return
    assert bf16.as_json()['activations']['transient_mib'] == round(copy_mib, 1)
    assert fp32.as_json()['activations']['transient_mib'] == 0
    assert any('copy it whole' in note for note in bf16.notes)
    assert not any('copy it whole' in note for note in fp32.notes)
