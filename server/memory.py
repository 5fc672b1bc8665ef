"""The worker's memory: resident set size, CUDA device memory, and glibc's malloc arenas.

Follows glibc's `mallopt(3)` and `malloc_trim(3)`: CPython frees large request buffers to malloc,
which keeps them in per-thread arenas unless it is told to give them back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from functools import cache

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
# arenas for the worker's threads: glibc's default is 8 per core, each keeping freed blocks;
# the event loop, two preparation threads and one execution thread share these
ARENA_MAX = 2
PAGE = os.sysconf("SC_PAGE_SIZE")


@cache
def libc() -> ctypes.CDLL | None:
    """glibc, or None on a platform without malloc_trim."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    library = ctypes.CDLL(name)
    return library if hasattr(library, "malloc_trim") else None


def limit_arenas(arenas: int = ARENA_MAX) -> bool:
    """Cap glibc's malloc arenas for threads started from now on; False where unavailable."""
    library = libc()
    return bool(library is not None and library.mallopt(M_ARENA_MAX, arenas))


def trim() -> bool:
    """Give freed heap memory back to the system (malloc_trim(0)); True if some was."""
    library = libc()
    return bool(library is not None and library.malloc_trim(0))


def rss_bytes() -> int:
    """This process's resident set size, from /proc/self/statm (0 where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE
    except OSError:
        return 0


def cuda_bytes() -> dict[str, int]:
    """Device memory allocated and reserved by torch, when torch already runs CUDA here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {
        "allocated": int(torch.cuda.memory_allocated()),
        "reserved": int(torch.cuda.memory_reserved()),
    }
