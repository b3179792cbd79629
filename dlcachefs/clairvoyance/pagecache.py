"""Whether the kernel's page cache serves a stream's epoch: its verdict from the opens.

A stream counts the opens of cached files whose bytes could be loaded lazily, and how
many of them were READ: the others the kernel served from its page cache. An epoch
served so (the dataset fits in RAM) has the next one read nothing ahead from the logs
(``served``): no read plan, no preloads, each open loaded at its first READ, if one
comes. Within an epoch a window of the last outcomes turns the verdict either way.

Concurrency: trio loop only (the engine's open, read and release).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

#: an epoch whose opens of cached files were at least this many, and of which at most
#: one in PAGED_READ_EVERY was READ, was served by the kernel's page cache
#: (PageVerdict.served)
PAGED_MIN_OPENS = 32
PAGED_READ_EVERY = 10
#: within an epoch, a window of PAGED_MIN_OPENS outcomes with at most one READ in this
#: many starts ``served`` (a stricter bound than the one that ends it: hysteresis)
PAGED_FOUND_EVERY = 30


class PageVerdict:
    """One stream's page-cache verdict and the counts it is judged from."""

    __slots__ = ("cached_opens", "cached_reads", "served", "page_count", "recent_opens",
                 "recent_reads", "lost", "judged", "_on_found")

    def __init__(self, on_found: Callable[[], None] = lambda: None) -> None:
        """``on_found``: called when a window finds the pages serving the epoch (the
        stream gives up the next epoch's log it lays out)."""
        # opens of cached files this epoch, and how many of them were READ
        self.cached_opens = 0
        self.cached_reads = 0
        #: the kernel's pages serve this epoch (judged at the switch, and by windows)
        self.served = False
        #: which epoch's count an open is in (bumped at each switch): an open counted in
        #: one epoch whose READ, or release, comes after the switch is not the next's
        self.page_count = 0
        # the last PAGED_MIN_OPENS of them whose outcome is known (READ, or released
        # without one): READs coming back (the kernel dropped the pages) end ``served``
        # at once, and the epoch's read plan starts (``lost``) or resumes; hardly any (at
        # most one in PAGED_FOUND_EVERY: the kernel holds what the last epoch read) start
        # it, and the plan pauses (it read the epoch after the first one whole again, for
        # opens the kernel served). The stricter bound to start it keeps a kernel that
        # holds most pages from flipping the verdict at every window.
        self.recent_opens = 0
        self.recent_reads = 0
        #: set when ``served`` ends within the epoch (the read plan waits on it)
        self.lost = trio.Event()
        #: a window of this epoch's opens was judged (a read plan reads only a little
        #: ahead until then: readplan.FIRST_LEAD)
        self.judged = False
        self._on_found = on_found

    def end_epoch(self, same_dataset: bool = True) -> None:
        """An epoch switch: decide from the epoch that ended whether the kernel's page
        cache serves this stream (see ``served``), and count anew. Another dataset than
        the last epoch's: nothing is known of its pages."""
        n, r = self.cached_opens, self.cached_reads
        self.served = same_dataset and n >= PAGED_MIN_OPENS and r * PAGED_READ_EVERY <= n
        self.cached_opens = self.cached_reads = self.recent_opens = self.recent_reads = 0
        self.page_count += 1
        self.lost = trio.Event()
        self.judged = False

    def note_cached_open(self) -> int:
        """An open of a cached file whose bytes could be loaded lazily: counted for the
        epoch's verdict; its outcome, a READ (:meth:`note_cached_read`) or none
        (:meth:`note_unread`), is counted in the current window. Returns the count it is
        in, for its outcome."""
        self.cached_opens += 1
        return self.page_count

    def note_cached_read(self, count: int) -> None:
        """The first READ of such an open: the kernel's pages did not serve it."""
        if count != self.page_count:
            return  # opened in an epoch that has ended
        self.cached_reads += 1
        self.recent_reads += 1
        self._judge()

    def note_unread(self, count: int) -> None:
        """Such an open was released with no READ: the kernel's pages served it."""
        if count == self.page_count:
            self._judge()

    def _judge(self) -> None:
        """One more outcome in the window; every PAGED_MIN_OPENS of them, a page-served
        stream whose READs came back (more than one in PAGED_READ_EVERY) is served so no
        longer (``lost`` set), and one whose READs hardly come (at most one in
        PAGED_FOUND_EVERY) is served so from now on (its plan pauses). Outcomes, not
        opens: many opens answered before their READs come (a loader with many threads)
        would look served."""
        self.recent_opens += 1
        if self.recent_opens < PAGED_MIN_OPENS:
            return
        self.judged = True
        if self.served and self.recent_reads * PAGED_READ_EVERY > self.recent_opens:
            self.served = False
            self.lost.set()
        elif not self.served and self.recent_reads * PAGED_FOUND_EVERY <= self.recent_opens:
            self.served = True
            self.lost = trio.Event()
            self._on_found()
        self.recent_opens = self.recent_reads = 0

    def stats(self) -> dict:
        return {"cached_opens": self.cached_opens, "read": self.cached_reads,
                "serves_this_epoch": self.served}
