"""The eviction policy interface.

A policy makes decisions only: it never does I/O and never touches the index. The chunk
writer tells it what happens to chunks (inserted, accessed, removed) and asks it, when
space is needed, which chunks to give up. It runs on the trio loop, so it needs no locks,
and it must be quick (it is called on the read path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection


class EvictionPolicy(ABC):
    """Chooses whole chunks to evict when the cache needs space."""

    #: the name it is registered and selected under (``--policy NAME``)
    name: str = ""

    @abstractmethod
    def on_insert(self, chunk_id: int, size: int) -> None:
        """A chunk of ``size`` bytes was sealed and indexed."""

    @abstractmethod
    def on_access(self, chunk_id: int) -> None:
        """A record of the chunk was served."""

    @abstractmethod
    def on_remove(self, chunk_id: int) -> None:
        """The chunk left the cache (evicted or dropped)."""

    @abstractmethod
    def victims(self, need_bytes: int, exclude: Collection[int]) -> list[int]:
        """Chunks whose eviction frees at least ``need_bytes`` (fewer if impossible).

        ``exclude`` holds chunks that must stay (pinned by in-flight reads). The returned
        chunks are removed by the caller, which then calls :meth:`on_remove` for each.
        """

    def __len__(self) -> int:  # number of chunks tracked
        return 0
