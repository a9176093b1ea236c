"""What this process holds: now (the plan's fixed cost) and at its peak (the training log).

On CUDA the allocator's count; on the CPU the resident set (Linux ``/proc``, and
``getrusage``'s peak).
"""
from __future__ import annotations

import os.path as osp
import resource
import sys

import torch


def rss_mib() -> float:
    """This process's resident memory now (Linux), MiB; 0 where /proc is missing."""
    if not osp.exists('/proc/self/status'):
        return 0.0
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_memory_mb() -> float:
    """This process's peak memory: CUDA allocator peak if on CUDA, else peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == 'darwin' else peak / 2**10  # bytes vs KiB
