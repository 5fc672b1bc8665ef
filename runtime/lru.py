"""One small least-recently-used map, for every cache the runtime keeps (prefixes, vision tables,
bound shapes, captured graphs, sessions)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most `size` entries; the least recently used goes first, through `on_evict` if given.
    Size 0 keeps nothing."""

    def __init__(self, size: int, on_evict: Callable[[K, V], None] | None = None):
        self.size = size
        self.on_evict = on_evict
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: K) -> V | None:
        value = self.entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        if self.size <= 0:
            return value
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            old_key, old_value = self.entries.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old_key, old_value)
        return value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        value = self.get(key)
        return self.put(key, make()) if value is None else value

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[K]:
        return iter(self.entries)

    def values(self) -> list[V]:
        return list(self.entries.values())

    def clear(self) -> None:
        self.entries.clear()
