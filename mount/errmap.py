"""Exceptions to errno, in one place.

Every ``Operations`` method is wrapped with :func:`fuse_errors`. Core exceptions map by
class (the most specific class wins); an ``OSError`` keeps its errno; anything else is
a bug: it is logged once per exception type with its traceback and answered with EIO,
so a client sees an error, never a hung request or a dead daemon.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pyfuse3

from dlcachefs import errors as E
from dlcachefs.store import integrity

log = logging.getLogger(__name__)

ERRNO: dict[type[BaseException], int] = {
    E.NotFound: errno.ENOENT,
    E.NotADirectory: errno.ENOTDIR,
    E.IsADirectory: errno.EISDIR,
    E.ReadOnly: errno.EROFS,
    E.PermissionDenied: errno.EACCES,
    E.InvalidArgument: errno.EINVAL,
    E.ControlError: errno.EINVAL,
    E.SourceTimeout: errno.ETIMEDOUT,
    E.SourceChanged: errno.ESTALE,
    E.OutsideSource: errno.EACCES,
    E.ChecksumMismatch: errno.EIO,
    E.FormatError: errno.EIO,
    E.CacheLocked: errno.EBUSY,
}

_logged: set[type[BaseException]] = set()


def errno_for(exc: BaseException) -> int:
    """The errno a client sees for ``exc``."""
    for cls in type(exc).__mro__:
        if cls in ERRNO:
            return ERRNO[cls]
    if isinstance(exc, E.SourceError):
        return exc.errno or errno.EIO
    if isinstance(exc, OSError):
        return exc.errno or errno.EIO
    return errno.EIO


T = TypeVar("T")


def fuse_errors(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate an async ``Operations`` method so that only FUSEError leaves it."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except E.DlcError as exc:
            log.debug("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(errno_for(exc)) from None
        except Exception as exc:
            if integrity.note_error(exc):  # a damaged index: the stop will not bless it
                raise pyfuse3.FUSEError(errno.EIO) from None
            if type(exc) not in _logged:
                _logged.add(type(exc))
                log.exception("unexpected error in %s; answering %s", fn.__name__,
                              errno.errorcode.get(errno_for(exc), "EIO"))
            raise pyfuse3.FUSEError(errno_for(exc)) from None

    return wrapper
