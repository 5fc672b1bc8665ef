"""Per-process thread pools (`runtime.pools`): one pool a name in a process, a new one after
`forget` and in a forked child (whose inherited pool has no threads)."""

from __future__ import annotations

import multiprocessing
import os

from runtime import pools


def test_one_pool_a_name_until_forgotten():
    first = pools.process_pool("test-a", 2)
    assert pools.process_pool("test-a", 2) is first
    assert pools.process_pool("test-b", 1) is not first
    assert first.submit(lambda: 41 + 1).result() == 42
    pools.forget("test-a")
    again = pools.process_pool("test-a", 2)
    assert again is not first and again.submit(os.getpid).result() == os.getpid()
    pools.forget("test-a")
    pools.forget("test-b")


def child_runs(queue) -> None:
    queue.put(pools.process_pool("test-fork", 1).submit(os.getpid).result(timeout=10))


def test_a_forked_child_makes_its_own_pool():
    pools.process_pool("test-fork", 1).submit(int).result()  # made, with a thread, here
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=child_runs, args=(queue,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == child.pid  # the child's pool ran in the child
    pools.forget("test-fork")
