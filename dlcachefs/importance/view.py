"""The policy's view of the samples' importance in a mount (its
:class:`~dlcachefs.cache.policy.ImportanceView`): the importance table of the dataset
whose jobs report losses (:class:`~dlcachefs.importance.scores.Importance`, by dataset
index), seen by inode. Runs on the trio loop, like the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dlcachefs.importance.scores import Importance

log = logging.getLogger(__name__)


class InodeImportance:
    """Importance by inode, for the dataset whose jobs report losses."""

    def __init__(self) -> None:
        self.table: Importance | None = None
        self.index_of: dict[int, int] = {}
        self.dataset: str | None = None
        self.current_epoch = 0

    def bind(self, dataset: str, inos: Sequence[int], h_fraction: float) -> None:
        if self.dataset == dataset and self.table is not None and self.table.n == len(inos):
            return
        if self.table is not None:  # one dataset's importance at a time (see docs/importance.md)
            # (the losses this drops are counted and warned of by the caller that knows
            # them: importance.losses)
            log.info("importance: now for dataset %r, no longer %r", dataset, self.dataset)
        self.dataset = dataset
        self.table = Importance(len(inos), h_fraction)
        self.index_of = {ino: i for i, ino in enumerate(inos) if ino}

    def importance(self, sample: int) -> float | None:
        i = self.index_of.get(sample)
        return None if i is None or self.table is None else self.table.value(i)

    def is_high(self, sample: int) -> bool:
        i = self.index_of.get(sample)
        # a file outside the dataset is never a substitution candidate: count it as H
        return True if i is None or self.table is None else self.table.is_high(i)

    def version(self) -> int:
        return 0 if self.table is None else self.table.version()

    def epoch(self) -> int:
        return self.current_epoch
