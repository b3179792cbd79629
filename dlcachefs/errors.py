"""Domain exceptions raised by the core.

The core never chooses an errno: it raises one of these, and the FUSE adapter maps them
to errno in one place (``dlcachefs.mount.errmap``). Each class says what went wrong in
the terms of the cache, so that the core stays testable without a kernel.
"""

from __future__ import annotations


class DlcError(Exception):
    """Base class of every error the core raises on purpose."""


class NotFound(DlcError):
    """No such entry in the namespace, or the source file has vanished."""


class NotADirectory(DlcError):
    """A directory operation on something that is not a directory."""


class IsADirectory(DlcError):
    """A file operation on a directory."""


class ReadOnly(DlcError):
    """Any attempt to modify the mirror."""


class PermissionDenied(DlcError):
    """The caller may not do this (for example: write the control file of another user's mount)."""


class InvalidArgument(DlcError):
    """A malformed request that is not a control-file line (bad offset, bad flags...)."""


class ControlError(DlcError):
    """A refused control-file write; ``str(exc)`` is the readable reason."""


class SourceError(DlcError):
    """Reading the source failed; ``errno`` is the source's own errno when it had one."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class SourceTimeout(SourceError):
    """The source did not answer within the configured timeout."""


class SourceChanged(SourceError):
    """The source file kept changing while it was fetched; no consistent version exists."""


class OutsideSource(SourceError):
    """A path resolved outside the source root (a symlink escape); refused."""


class ChecksumMismatch(DlcError):
    """Cached bytes failed their checksum. Never surfaces to a client: the engine refetches."""


class FormatError(DlcError):
    """A chunk, record or log header is malformed (torn write, corruption, wrong version)."""


class CacheLocked(DlcError):
    """Another daemon holds the cache directory."""


class SourceMismatch(DlcError):
    """A cache directory (or a shared root's dataset) that holds the cache of another
    source: mounting it over this one would serve the other source's tree and bytes."""


class IndexDamaged(DlcError):
    """The cache index disagrees with itself in a way recovery cannot recount (found at
    start-up, ``--debug-invariants``): the daemon sets the index aside and starts with
    an empty cache rather than refuse the mount."""
