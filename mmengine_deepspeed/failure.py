"""One rank's failure ends every rank within seconds, whatever the group's timeout.

A rank that raises (a corrupt sample, an OOM, a data-dependent bug) stops
taking part in collectives while its peers are already inside one (DeepSpeed's
gradient all-reduce); they would wait there for the process group's timeout,
30 minutes by default, and NCCL would not even notice the peer is gone. So the
failing rank says so through the job's rendezvous store (the TCPStore every
launcher already provides), and every other rank watches that key from a
daemon thread: on seeing it, it prints one line naming the failed rank and its
error and leaves with :data:`PEER_FAILED_EXIT`, from wherever its main thread
is blocked. The failing rank records its error for torchrun's summary (which
then names it as the root cause) and, where the store lives in its own process
(no elastic agent), waits briefly until its peers have seen the failure; then
it raises as usual, so its traceback is the one error in the log; and it
skips the exit barrier of ``dist.py``, which would wait for peers that are
gone.

Only the first failure is published (``compare_set``): a rank that fails
because of another's failure reports that one. The keys live under the same
per-world prefix as the rendezvous, so an old attempt's failure never stops
a restarted job (``--max-restarts``).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Optional

import torch.distributed as torch_dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

# How often a rank looks for a peer's failure, and how long a failing rank
# waits for its peers to have seen it (the store may live in its process).
POLL_S = 0.5
ACK_WAIT_S = 10.0
# Under torchrun, how long a stopped rank waits for the failed one to leave first, and after.
EXIT_WAIT_S = 10.0
EXIT_GRACE_S = 1.0
# The exit status of a rank stopped because another rank failed.
PEER_FAILED_EXIT = 1
STORE_TIMEOUT = datetime.timedelta(seconds=30)
# For a failing or leaving rank: the store may be gone with the rank that held it.
LATE_STORE_TIMEOUT = datetime.timedelta(seconds=3)

logger = logging.getLogger(__name__)


class _Channel:
    """This rank's view of the job's failure key: publish, watch, acknowledge."""

    def __init__(self, prefix: str, rank: int, world_size: int):
        self.prefix = prefix
        self.key, self.ack_key = f'{prefix}failure', f'{prefix}failure_seen'
        self.exited_key = f'{prefix}failure_exiting'
        self.rank, self.world_size = rank, world_size
        self.failed = False  # this rank failed (or saw a peer fail): skip the exit barrier
        self.published = False  # this rank's failure is the one published
        self._agreements = 0  # flagged(): the agreements this world has asked so far
        self._stop = threading.Event()
        # Clients of our own: the main thread's store (the process group's)
        # may be held by a blocking call when the watcher needs one.
        self._watch_store = self._client()
        self._thread = threading.Thread(target=self._watch, name='mmengine_deepspeed-failure',
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _client(timeout: datetime.timedelta = STORE_TIMEOUT) -> torch_dist.TCPStore:
        return torch_dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']),
                                   is_master=False, timeout=timeout)

    def _watch(self) -> None:
        store = self._watch_store
        while not self._stop.wait(POLL_S):
            try:
                if not store.check([self.key]):
                    continue
                failed_rank, _, error = store.get(self.key).decode().partition(':')
                store.add(self.ack_key, 1)
            except Exception:  # the store went away: the job is ending anyway
                return
            if int(failed_rank) == self.rank or self._stop.is_set():
                return
            self.failed = True
            _say(f'[rank {self.rank}] stopping: rank {failed_rank} failed ({error}); its '
                 'traceback is in its log. Exiting so the job ends now instead of '
                 'waiting for the process-group timeout.')
            if _agent_keeps_store():
                # Let the failed rank leave first: the agent's summary names the first
                # rank it sees exit as the root cause.
                self._wait_for(store, self.exited_key, EXIT_WAIT_S)
                time.sleep(EXIT_GRACE_S)
            os._exit(PEER_FAILED_EXIT)

    @staticmethod
    def _wait_for(store: torch_dist.TCPStore, key: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with contextlib.suppress(Exception):  # a store gone: stop waiting
            while not store.check([key]) and time.monotonic() < deadline:
                time.sleep(POLL_S / 5)

    def publish(self, error: BaseException) -> None:
        """Tell every rank that this one failed; without an agent (the store lives in rank
        0's process), wait until they have seen it."""
        if self.failed:
            return
        self.failed = True
        self._stop.set()
        record_for_torchrun(error)
        summary = ' '.join(f'{type(error).__name__}: {error}'.split())[:500]
        try:
            store = self._client(LATE_STORE_TIMEOUT)
            first = store.compare_set(self.key, '', f'{self.rank}:{summary}').decode()
            if not first.startswith(f'{self.rank}:'):
                _say(f'[rank {self.rank}] failed after rank {first.partition(":")[0]} did: '
                     f'{first.partition(":")[2]}')
                return
            self.published = True
            if _agent_keeps_store():
                return  # the store lives in the agent, which outlives this rank
            deadline = time.monotonic() + ACK_WAIT_S
            while store.add(self.ack_key, 0) < self.world_size - 1 \
                    and time.monotonic() < deadline:
                time.sleep(POLL_S / 5)
        except Exception as e:  # the store is gone: the launcher is already ending the job
            logger.debug(f'Could not publish the failure of rank {self.rank}: {e}')

    def flagged(self, name: str, flag: bool, seconds: float) -> list[int]:
        """The ranks whose ``flag`` is set in the agreement ``name`` (see
        :func:`flagged_ranks`)."""
        # numbered in the world: a key of an earlier agreement (another run in this process
        # group, of the same name) is never read as this one's
        self._agreements += 1
        base = f'{self.prefix}agreement/{self._agreements}/{name}/'
        keys = [f'{base}{rank}' for rank in range(self.world_size)]
        store = self._client(datetime.timedelta(seconds=seconds))
        store.set(keys[self.rank], '1' if flag else '0')
        try:
            store.wait(keys)
        except torch_dist.DistStoreError as e:
            raise TimeoutError(f'Not every rank reached the agreement {name!r} within '
                               f'{seconds:.0f} s.') from e
        return [rank for rank, value in enumerate(store.multi_get(keys)) if value == b'1']

    def close(self) -> None:
        """Stop watching (a clean exit, or the process group's teardown); a rank whose
        failure was published says it is leaving, which its peers wait for."""
        self._stop.set()
        if self.published and _agent_keeps_store():  # (without one, the store may be gone)
            with contextlib.suppress(Exception):
                self._client(LATE_STORE_TIMEOUT).set(self.exited_key, '1')
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S)


def _agent_keeps_store() -> bool:
    """Whether an elastic agent (torchrun) holds the store and watches the ranks' exits."""
    return os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True'


def record_for_torchrun(error: BaseException) -> None:
    """Write ``error`` where torchrun's summary looks for a rank's root cause.

    torch's error handler writes ``TORCHELASTIC_ERROR_FILE`` in place, and the
    agent reads the file as soon as it sees any rank exit: here a peer that
    this failure stopped, or the agent tearing down after a rank was killed.
    A half-written file crashed the agent itself (``JSONDecodeError``), so the
    file is written aside and renamed into place, before any peer can stop.
    """
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path:
        return
    aside = f'{path}.{os.getpid()}.tmp'
    os.environ['TORCHELASTIC_ERROR_FILE'] = aside
    try:
        get_error_handler().record_exception(error)
        os.replace(aside, path)
    except OSError as e:
        logger.debug(f'Could not record the error for torchrun: {e}')
    finally:
        os.environ['TORCHELASTIC_ERROR_FILE'] = path


def _say(line: str) -> None:
    """One line on stderr, flushed before a hard exit."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


_channel: list[_Channel] = []  # the current world's, if it has more than one rank
_previous_excepthook = sys.excepthook


def watch_for_peer_failures(prefix: str, rank: int, world_size: int) -> None:
    """Start watching for a failure of another rank (after the group exists).

    Args:
        prefix (str): This world's key prefix in the rendezvous store.
        rank (int): This process's rank.
        world_size (int): The number of ranks; one rank has no peers to stop.
    """
    stop_watching()
    if world_size > 1:
        _channel.append(_Channel(prefix, rank, world_size))
        sys.excepthook = _excepthook


def stop_watching() -> None:
    """Stop the watcher of the current world (a clean exit or teardown)."""
    while _channel:
        _channel.pop().close()


def report_failure(error: BaseException) -> None:
    """Publish ``error`` as this rank's failure (the first one published wins)."""
    if _channel:
        _channel[0].publish(error)


def flagged_ranks(name: str, flag: bool, rank: int, seconds: float) -> list[int]:
    """Every rank's answer to one question (``flag``), agreed through the rendezvous store:
    the ranks that said yes, the same list on every rank.

    For an agreement that a rank may join from an error path (an out-of-memory error in
    its forward) while its peers may be inside a collective that it will never reach (a
    model's own all-reduce in its loss): a collective would wait for the process group's
    timeout there; this waits ``seconds`` at most, then raises, and the raising rank's
    failure ends every rank. One store round trip each: for set-up and trial iterations,
    not for every iteration.

    Every rank must ask the same agreements in the same order: they are numbered in the
    world (``name`` says what is agreed, for the store's keys and errors).

    Args:
        name (str): What is agreed.
        flag (bool): This rank's answer.
        rank (int): This rank (the answer of a single process is its own).
        seconds (float): How long to wait for every rank's answer.

    Raises:
        TimeoutError: A rank did not answer within ``seconds``.
    """
    if not _channel:
        return [rank] if flag else []
    return _channel[0].flagged(name, flag, seconds)


def rank_failed() -> bool:
    """Whether this rank failed or saw a peer fail (its exit must not wait for peers)."""
    return bool(_channel) and _channel[0].failed


class AgreedExit(SystemExit):
    """Every rank leaves ``train()`` together, with this exit status, after agreeing to.

    A ``SystemExit``, so no traceback; raised on every rank alike (a preemption's
    checkpoint taken, a non-finite policy's stop), so no single rank's failure.
    """


def is_failure(error: BaseException) -> bool:
    """Whether ``error`` ends this rank alone (not a clean or agreed exit)."""
    if isinstance(error, SystemExit):
        return error.code not in (None, 0) and not isinstance(error, AgreedExit)
    return True


@contextmanager
def failing_together() -> Iterator[None]:
    """Publish any failure that leaves the block, then let it propagate."""
    try:
        yield
    except BaseException as e:
        if is_failure(e):
            report_failure(e)
        raise


def _excepthook(kind: type[BaseException], error: BaseException,
                tb: Optional[TracebackType]) -> None:
    """An uncaught error outside the runner (the user's script) fails the job too."""
    if is_failure(error):
        report_failure(error)
    _previous_excepthook(kind, error, tb)
