"""failure.py's agreement through the rendezvous store: two ranks in two processes of this
test (a store of their own, no process group), one of them never answering."""
from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import torch.distributed as torch_dist

from mmengine_deepspeed import failure
from tests.helpers import free_port


def _rank(port: int, rank: int, flag: bool, answer: bool, queue: Any) -> None:
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    store = torch_dist.TCPStore('127.0.0.1', port, 2, is_master=rank == 0)
    failure.watch_for_peer_failures('test/', rank, 2)
    try:
        if not answer:
            time.sleep(4)  # inside something that never reaches the agreement
            queue.put((rank, 'silent'))
            return
        start = time.monotonic()
        try:
            queue.put((rank, failure.flagged_ranks('q1', flag, rank, 2.0)))
        except TimeoutError as e:
            queue.put((rank, f'{e} after {time.monotonic() - start:.0f} s'))
    finally:
        failure.stop_watching()
        del store


def _agree(answers: list[tuple[bool, bool]]) -> dict[int, Any]:
    port, queue = free_port(), multiprocessing.get_context('spawn').Queue()
    procs = [multiprocessing.get_context('spawn').Process(
        target=_rank, args=(port, rank, flag, answer, queue))
        for rank, (flag, answer) in enumerate(answers)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=30) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    return results


def test_every_rank_gets_the_ranks_that_said_yes() -> None:
    assert _agree([(False, True), (True, True)]) == {0: [1], 1: [1]}
    assert _agree([(False, True), (False, True)]) == {0: [], 1: []}


def _twice(port: int, rank: int, queue: Any) -> None:
    """Two agreements of one name: rank 1 says yes to the first, and answers the second late."""
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    store = torch_dist.TCPStore('127.0.0.1', port, 2, is_master=rank == 0)
    failure.watch_for_peer_failures('test/', rank, 2)
    try:
        first = failure.flagged_ranks('q', rank == 1, rank, 10.0)
        if rank == 1:
            time.sleep(1.5)
        queue.put((rank, (first, failure.flagged_ranks('q', False, rank, 10.0))))
    finally:
        failure.stop_watching()
        del store


def test_an_earlier_agreement_of_the_same_name_is_never_read() -> None:
    """Agreements are numbered in the world: rank 0, first to the second one, waits for rank
    1's answer to it instead of reading rank 1's yes to the first (two runs in one process
    group ask the same question)."""
    port, context = free_port(), multiprocessing.get_context('spawn')
    queue = context.Queue()
    procs = [context.Process(target=_twice, args=(port, rank, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=30) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert results == {0: ([1], []), 1: ([1], [])}


def test_a_rank_that_never_answers_ends_the_wait_in_its_time() -> None:
    """Rank 1 is elsewhere (a collective rank 0 will not reach): rank 0's wait ends after
    its 2 s with an error, not at the process group's timeout."""
    results = _agree([(True, True), (False, False)])
    assert results[0] == "Not every rank reached the agreement 'q1' within 2 s. after 2 s", \
        results


def test_one_process_answers_itself() -> None:
    assert failure.flagged_ranks('alone', True, 0, 1.0) == [0]
    assert failure.flagged_ranks('alone', False, 0, 1.0) == []

