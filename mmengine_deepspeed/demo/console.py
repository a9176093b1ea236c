"""What the demo shows on the console: a progress bar, the validation lines, the summary.

The demo is a first impression; MMEngine's environment dump and DeepSpeed's
start-up warnings (once per process) would bury it. :func:`captured` sends a
process's stdout and stderr, at the file-descriptor level so that C++ and
child-process output go too, to a log file in the work directory, and hands
back the real console. :class:`DemoProgressHook` draws on that console from
rank 0. ``mmengine-deepspeed train`` keeps MMEngine's usual console.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional, TextIO

from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from typing_extensions import override

BAR_WIDTH = 30

# The console of this process while it is captured (rank 0 only), for the hook.
_console: Optional[TextIO] = None


@contextmanager
def captured(log_path: str, show_progress: bool) -> Iterator[TextIO]:
    """This process's output goes to ``log_path``; yields the real console.

    Args:
        log_path (str): The file that receives everything printed (appended).
        show_progress (bool): Let :class:`DemoProgressHook` draw on the
            console (rank 0).

    Yields:
        TextIO: The console, line-buffered.
    """
    global _console
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved[0]), 'w', buffering=1)
    with open(log_path, 'a', encoding='utf-8') as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        if show_progress:
            _console = console
        try:
            yield console
        finally:
            _console = None
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            console.close()


def progress_line(done: int, total: int, loss: float, elapsed: float) -> str:
    """``[#####.....]  120/300  loss 1.234  ETA 0:42``."""
    filled = int(BAR_WIDTH * done / max(total, 1))
    left = elapsed / max(done, 1) * (total - done)
    return (f'[{"#" * filled}{"." * (BAR_WIDTH - filled)}] {done:>{len(str(total))}}/{total}  '
            f'loss {loss:.3f}  ETA {int(left // 60)}:{int(left % 60):02d}')


@HOOKS.register_module()
class DemoProgressHook(Hook):
    """A one-line progress bar with loss and ETA, and the validation lines (rank 0).

    The bar is redrawn every ``interval`` iterations, not every one: reading the loss
    on the host waits for the device, which the rest of the run never does per iteration.

    Args:
        interval (int): Iterations between redraws (and the last one). Defaults to 10.
    """

    priority = 'VERY_LOW'

    def __init__(self, interval: int = 10) -> None:
        self._start = 0.0
        self.interval = interval

    @override
    def before_train(self, runner: Any) -> None:
        self._start = time.perf_counter()

    @override
    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        done = runner.iter + 1
        if _console is None or not outputs or 'loss' not in outputs \
                or (done % self.interval and done != runner.max_iters):
            return
        line = progress_line(done, runner.max_iters, float(outputs['loss'].detach()),
                             time.perf_counter() - self._start)
        _console.write('\r' + line)
        _console.flush()

    @override
    def after_val_epoch(self, runner: Any, metrics: Optional[dict] = None) -> None:
        if _console is None or not metrics:
            return
        shown = '  '.join(f'{k} {float(v):.3f}' for k, v in metrics.items())
        _console.write(f'\n  validation at iteration {runner.iter}: {shown}\n')

    @override
    def after_train(self, runner: Any) -> None:
        if _console is not None:
            _console.write('\n')
