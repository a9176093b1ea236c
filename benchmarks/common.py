"""What the benchmarks share: models, synthetic data, configs, a torchrun helper."""
from __future__ import annotations

import gc
import json
import os
import os.path as osp
import statistics
import subprocess
import sys
from typing import Any, Optional

import torch
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch import nn
from torch.utils.data import Dataset

from mmengine_deepspeed.dist import free_port
from mmengine_deepspeed.zero.partitioned import return_freed_memory

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))

# Sized so that one step takes roughly 50-200 ms on a 2-core CPU ("gpt"), and
# so that fixed per-iteration costs dominate ("tiny").
MODELS_CFG = {
    'gpt': dict(type='TinyGPT', block_size=64, width=192, depth=3, heads=4),
    'tiny': dict(type='BenchTinyMLP'),
    # ~4.5M parameters, fp32 (FP32_MODELS): a step of ~100-250 ms in plain matmuls
    'mlp': dict(type='BenchMLP'),
    # large enough that model states dominate memory and checkpoint size
    'big': dict(type='TinyGPT', block_size=64, width=1024, depth=4, heads=8),
    # GPU mode: ~129M parameters (a byte vocabulary, so 18 blocks of width 768
    # stand in for GPT-2 small's 12 blocks plus its 38M-parameter embedding)
    'gpt125m': dict(type='TinyGPT', block_size=1024, width=768, depth=18, heads=12),
    # host-bound: many small modules, so an iteration is mostly Python (overhead.py
    # --host-bound splits its host time between the loop, this package and DeepSpeed)
    'deep12': dict(type='TinyGPT', block_size=16, width=32, depth=12, heads=2),
    'deep24': dict(type='TinyGPT', block_size=16, width=32, depth=24, heads=2),
}
BATCH = {'gpt': 8, 'tiny': 8, 'mlp': 8, 'big': 1, 'gpt125m': 8, 'deep12': 2, 'deep24': 2}
FP32_MODELS = ('mlp',)
# Dense bf16 tensor-core peak per GPU, TFLOP/s, from the vendors' data sheets
# (without sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = (('H200', 989.4), ('H100', 989.4), ('H800', 989.4), ('GH200', 989.4),
                    ('A100', 312.0), ('A800', 312.0), ('L40S', 362.1), ('L40', 181.0),
                    ('A10G', 70.0), ('A10', 125.0), ('L4', 121.0), ('4090', 165.2),
                    ('3090', 71.0))


def train_flops_per_token(model_name: str, params: int) -> float:
    """Model FLOPs of one training token (forward and backward, no recomputation).

    6 per parameter (PaLM's accounting, appendix B) plus, for the GPT models,
    the attention scores and values: 12 x layers x context x width.
    """
    cfg = MODELS_CFG[model_name]
    attention = 12 * cfg['depth'] * cfg['block_size'] * cfg['width'] if 'depth' in cfg else 0
    return 6.0 * params + attention


def peak_tflops(device_name: str) -> Optional[float]:
    """The bf16 peak of a known GPU, or None (MFU is then left out)."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


@DATASETS.register_module()
class RandomTokens(Dataset):
    """Random byte sequences (inputs and next-byte targets), fixed by ``seed``."""

    def __init__(self, size: int = 4096, block_size: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(256, (size, block_size + 1), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index]
        return dict(inputs=row[:-1], targets=row[1:])


@MODELS.register_module()
class BenchTinyMLP(BaseModel):
    """A few thousand parameters: its step time is the framework's per-iteration cost."""

    def __init__(self, data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.embed = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = self.head(self.embed(inputs))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                         targets.flatten()))
        return logits


@MODELS.register_module()
class BenchMLP(BaseModel):
    """Byte embedding, 4 residual MLP blocks of width 512 (hidden 1024), byte head."""

    def __init__(self, data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.embed = nn.Embedding(256, 512)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
            for _ in range(4))
        self.head = nn.Linear(512, 256)

    def forward(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        hidden = self.embed(inputs)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        logits = self.head(hidden)
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                         targets.flatten()))
        return logits


def ds_config(stage: int, offload: bool = False, model: str = '') -> dict:
    zero: dict[str, Any] = {'stage': stage}
    if offload:
        zero.update(offload_optimizer={'device': 'cpu'}, offload_param={'device': 'cpu'})
    return {'zero_optimization': zero, 'bf16': {'enabled': model not in FP32_MODELS}}


def device_ranks() -> int:
    """Ranks to launch: 2 on CPU (gloo); on CUDA one per GPU, at most 2 (NCCL wants
    a GPU of its own per rank)."""
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def device_name() -> str:
    """The GPU's name, or the CPU's model name (a timing is only as good as its machine)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        with open('/proc/cpuinfo', encoding='utf-8') as info:
            return 'CPU ' + next(line.split(':', 1)[1].strip() for line in info
                                 if line.startswith('model name'))
    except (OSError, StopIteration):
        return 'CPU (model unknown)'


def torchrun(script: str, args: list[str], nproc: int = 2, timeout: float = 900) -> list[dict]:
    """Run ``script`` on ``nproc`` ranks; return the JSON lines it printed with ``RESULT``."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS='1')
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}',
           '--master_addr=127.0.0.1', f'--master_port={free_port()}', script, *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f'{" ".join(cmd)} failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}')
    return [json.loads(line.split('RESULT ', 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith('RESULT ')]


def deepspeed_estimate_mib(stage: int, params: int, largest: int, world: int,
                           zero_init: bool = True, offload: bool = False) -> Optional[float]:
    """DeepSpeed's model-states estimate for one rank on one node, MiB: device plus this
    rank's share of the host (``estimate_zero2/3_model_states_mem_needs``, what the
    ``..._all_live`` functions print; they assume 16-bit parameters and Adam). None for
    ZeRO-0/1, which DeepSpeed does not estimate."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        host, device = estimate_zero2_model_states_mem_needs(
            params, num_gpus_per_node=world, num_nodes=1, cpu_offload=offload)
    elif stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        host, device, _ = estimate_zero3_model_states_mem_needs(
            params, largest, num_gpus_per_node=world, num_nodes=1, cpu_offload=offload,
            cpu_offload_params=offload, zero_init=zero_init)
    else:
        return None
    return (device + host / world) / 2**20


def spread(values: list[float]) -> str:
    """``min / median / max`` of per-round ratios."""
    return f'{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}'


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    def fmt(value: Any) -> str:
        return f'{value:.3f}' if isinstance(value, float) else str(value)
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(fmt(v) for v in row) + ' |' for row in rows]
    return '\n'.join(lines)


def status_kib(field: str) -> int:
    """A field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...), in KiB (Linux)."""
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'no {field} in /proc/self/status')


def live_rss_kib() -> int:
    """RSS after garbage collection and handing malloc's free memory back (glibc)."""
    gc.collect()
    return_freed_memory()
    return status_kib('VmRSS')


def reset_peak_rss() -> int:
    """Restart the peak RSS (``VmHWM``) at the live RSS, which is returned (KiB).

    Freed memory malloc still holds would be reused unseen by what is
    measured next; it is handed back first.
    """
    live = live_rss_kib()
    with open('/proc/self/clear_refs', 'w') as refs:
        refs.write('5')
    return live
