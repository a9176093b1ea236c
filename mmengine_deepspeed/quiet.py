"""DeepSpeed's console output: one copy of its messages, without its CPU notice.

Importing nothing of DeepSpeed itself, so the package can install the notice's filter
before anything it imports brings DeepSpeed in.
"""
from __future__ import annotations

import logging
import warnings

DEEPSPEED_DEPRECATION_NOISE = (r'`torch\.distributed\.all_gather_into_tensor` is deprecated',
                               r'`torch\.distributed\.reduce_scatter_tensor` is deprecated')


CPU_ACCELERATOR_NOTICE = 'Setting accelerator to CPU'


def _not_the_cpu_notice(record: logging.LogRecord) -> bool:
    return CPU_ACCELERATOR_NOTICE not in record.getMessage()


def hide_cpu_accelerator_notice() -> None:
    """Drop DeepSpeed's import-time "Setting accelerator to CPU ..." warning.

    DeepSpeed prints it once per process (every rank, and the parent of
    ``--nproc``) on machines without CUDA; the start-up banner states the
    device and backend a run uses, so the line only buries the first screen.
    A filter on DeepSpeed's logger, installed before DeepSpeed is imported
    (its level is reset at import, its filters are not).
    """
    ds_logger = logging.getLogger('DeepSpeed')
    if _not_the_cpu_notice not in ds_logger.filters:
        ds_logger.addFilter(_not_the_cpu_notice)


def quiet_deepspeed(rank: int, verbose: bool = False) -> None:
    """One copy of DeepSpeed's messages: warnings from rank 0, errors from all ranks.

    Args:
        rank (int): This process's rank.
        verbose (bool): Keep DeepSpeed's info messages on rank 0 (MMEngine
            ``log_level='DEBUG'``). Defaults to False.
    """
    from deepspeed.utils import logger as ds_logger

    level = logging.INFO if verbose else logging.WARNING
    ds_logger.setLevel(level if rank == 0 else logging.ERROR)
    for message in DEEPSPEED_DEPRECATION_NOISE:
        warnings.filterwarnings('ignore', message=message, category=FutureWarning)
