"""Thread pools made once per process: the image threads of `runtime.processing` and the PNG
decode threads of `runtime.images`. A forked child inherits a pool but not its threads, so it
makes its own."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}  # name -> (the process that made it, pool)
_lock = threading.Lock()


def process_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """This process's pool `name`, of `threads` threads when made (named omnijev-`name`)."""
    with _lock:
        made = _pools.get(name)
        if made is None or made[0] != os.getpid():
            made = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix=f"omnijev-{name}"))
            _pools[name] = made
        return made[1]


def forget(name: str) -> None:
    """Drop pool `name`, so that the next `process_pool` makes it anew (its threads finish)."""
    with _lock:
        made = _pools.pop(name, None)
    if made is not None:
        made[1].shutdown(wait=False)
