"""A stream's last epochs in numbers: the bytes it read from the source, and its opens
served without waiting (hits) or that waited for the source (misses), by epoch (the
``epochs`` of a stream in the stats).

Concurrency: trio loop, as the stream that holds it.
"""

from __future__ import annotations

#: epochs kept per stream (the oldest is dropped first)
MAX_EPOCHS = 16


class EpochHistory:
    """Per epoch: ``[bytes_from_source, hits, misses]``, for the last :data:`MAX_EPOCHS`
    epochs noted (an epoch read again adds to its numbers; an epoch more than one behind
    the newest begins a new history: a new run of the stream)."""

    __slots__ = ("_epochs",)

    def __init__(self) -> None:
        self._epochs: dict[int, list[int]] = {}

    def _of(self, epoch: int) -> list[int]:
        row = self._epochs.get(epoch)
        if row is None:
            if self._epochs and epoch < max(self._epochs) - 1:
                # far behind the newest: a new run of the stream (a job restarted at
                # epoch 0), not its late opens; its numbers are not the last run's
                self._epochs.clear()
            row = self._epochs[epoch] = [0, 0, 0]
            while len(self._epochs) > MAX_EPOCHS:
                del self._epochs[next(iter(self._epochs))]  # the first noted
        return row

    def note_source_bytes(self, epoch: int | None, n: int) -> None:
        """``n`` bytes read from the source for ``epoch`` (None: no epoch known yet, not
        kept)."""
        if epoch is not None and n:
            self._of(epoch)[0] += n

    def note_open(self, epoch: int | None, waited: bool) -> None:
        """An open of ``epoch`` served: a miss when it ``waited`` for the source."""
        if epoch is not None:
            self._of(epoch)[2 if waited else 1] += 1

    def stats(self) -> dict[str, dict[str, int]]:
        """``{"EPOCH": {"bytes_from_source", "hits", "misses"}}``, oldest epoch first."""
        return {str(e): {"bytes_from_source": b, "hits": h, "misses": m}
                for e, (b, h, m) in sorted(self._epochs.items())}
