"""Running a mount: lock the cache, start the engine, mount, serve, unmount, commit.

Order at start: a umask that keeps the cache directory the owner's (:func:`begin`), take
the cache lock (a second daemon on the same cache refuses), walk the index unless its last
clean stop marked it, open it, recover the logs, scan the source if needed (with
progress), set the cache directory's modes (:func:`set_cache_modes`), mount, then report
"ready" to the waiting parent. At stop (SIGINT/SIGTERM, or the kernel unmounting): stop
serving, unmount, seal and commit what is pending, close the index, walk it and mark it
clean if it is sound (:func:`mark_clean_if_sound`), drop the lock.

The daemon never makes a call on its own mountpoint (it would deadlock).
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import signal
import sys
import time
from collections.abc import Callable

import pyfuse3
import trio
from dlcachefs.mount import fuseloop
from dlcachefs.mount.ops import Operations

from dlcachefs import mountctl
from dlcachefs.config import DATASETS_DIR, Config
from dlcachefs.errors import DlcError, IndexDamaged
from dlcachefs.session import Session, build
from dlcachefs.store import integrity, ledger
from dlcachefs.store import modes as cache_modes
from dlcachefs.store.lock import CacheLock
from dlcachefs.store.tally import SOUND_FILE, TALLY_DIR

log = logging.getLogger("dlcachefs")

Reporter = Callable[[str], None]

#: how long a new mount waits for the daemon of the last one to exit when it still holds
#: the cache (unmounted, committing as it stops: `fusermount3 -u MNT` then a new mount)
STOPPING_WAIT_S = 10.0


def _wait_stopping(pid: int) -> bool:
    """Wait (at most :data:`STOPPING_WAIT_S`) for the stopping daemon ``pid`` that holds
    the cache to exit, as ``dlcachefs umount`` waits for it; True when it has."""
    log.info("the cache is held by daemon %d, which is no longer mounted (stopping): "
             "waiting up to %g s for it to exit", pid, STOPPING_WAIT_S)
    return mountctl.wait_gone(pid, STOPPING_WAIT_S)


def begin(cfg: Config) -> None:
    """The daemon's first step, before it creates anything: its umask, so that what it
    makes in the cache directory is its owner's (or readable by ``--reader-group``)
    whatever the umask it was started with (:mod:`dlcachefs.store.modes`); then its
    logging."""
    os.umask(cache_modes.daemon_umask(cfg.reader_group is not None))
    # a daemon started under `dlcachefs run` serves the mount: its opens (and those of
    # its replay worker and checks, through the environment) are never served from the
    # cache it writes
    from dlcachefs.data import intercept  # noqa: PLC0415

    intercept.uninstall()
    setup_logging(cfg)


def setup_logging(cfg: Config) -> None:
    root = logging.getLogger()
    root.setLevel(cfg.log_level.upper())
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.makedirs(cfg.data_dir, mode=cache_modes.DIR_MODE, exist_ok=True)
    fh = logging.handlers.RotatingFileHandler(
        os.path.join(cfg.data_dir, "dlcachefs.log"), maxBytes=10 << 20, backupCount=3)
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if cfg.foreground:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        root.addHandler(sh)


def check_mountpoint(path: str) -> None:
    """Refuse a mountpoint that is not a directory or is in use; clean a stale FUSE mount
    (one whose daemon died, for example by ``kill -9``: every call on it fails ENOTCONN)."""
    if mountctl.is_mounted(path, fuse=True):
        try:
            os.statvfs(path)  # needs a live daemon; the kernel cannot answer from its cache
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise DlcError(f"mountpoint {path}: {e.strerror}") from None
            log.warning("mountpoint %s is a stale FUSE mount; unmounting it", path)
            mountctl.unmount(path, lazy="at_once")
        else:
            raise DlcError(f"{path} is already a mount point")
    try:
        st_ok = os.path.isdir(path)
    except OSError as e:
        raise DlcError(f"mountpoint {path}: {e.strerror}") from None
    if not os.path.exists(path):
        raise DlcError(f"mountpoint does not exist: {path}")
    if not st_ok:
        raise DlcError(f"mountpoint is not a directory: {path}")
    if os.path.ismount(path):
        raise DlcError(f"{path} is already a mount point")


def raise_read_ahead(mountpoint: str, kb: int = 1024) -> None:
    """Raise the kernel's readahead for this mount (default 128 KB; DESIGN.md measured +28%
    files/s on small files and 2x on chunks). Best effort: needs root. Finds the mount's
    device in /proc/self/mountinfo, never by a call on the mountpoint (that would deadlock)."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if parts[4].encode().decode("unicode_escape") == mountpoint:
                    dev = parts[2]
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:  # noqa: F821
            f.write(str(kb))
    except (OSError, NameError, UnboundLocalError, IndexError) as e:
        log.debug("could not raise read_ahead_kb of %s: %s", mountpoint, e)


def fuse_options(cfg: Config) -> set[str]:
    opts = {"fsname=dlcachefs", "subtype=dlcachefs", "default_permissions", "noatime"}
    if cfg.allow_other:
        opts.add("allow_other")
    return opts


def check_index_or_quarantine(index_dir: str) -> bool:
    """Before the daemon maps its index: check it in a child process, and move it aside
    if it is damaged (reading a damaged LMDB file can kill the reader with SIGBUS or
    SIGABRT; see :mod:`dlcachefs.store.integrity`). The cache then starts empty. Whether
    the index was walked (False: as its last clean stop left it)."""
    if integrity.unchanged_since_clean_stop(index_dir):
        log.info("index unchanged since its last clean stop: not walked")
        return False
    t0 = time.monotonic()
    why = integrity.check_index(index_dir)
    if why is None:
        log.info("index checked in %.2f s", time.monotonic() - t0)
        return True
    _set_aside(index_dir, why)
    return True


def mark_clean_if_sound(index_dir: str) -> None:
    """After a clean stop: walk the index (in a child, as at a start) and mark it clean
    only if the walk passes, so that the next start may skip its walk. Damage written
    under the map on pages this run never read is found here, not by the next start's
    mapping (which an LMDB assertion would abort). The walk's time moves from the next
    start to this stop."""
    t0 = time.monotonic()
    try:
        why = integrity.check_at_stop(index_dir)
    except OSError as e:  # the child could not even start: the next start walks instead
        why = f"the walk could not run: {e}"
    if why is None:
        integrity.mark_clean(index_dir)
        log.info("index walked at the stop in %.2f s: marked clean", time.monotonic() - t0)
    else:
        log.warning("index %s not marked clean (%s): the next start walks it", index_dir,
                    why[:300])


def _set_aside(index_dir: str, why: str) -> None:
    dest = integrity.quarantine(index_dir)
    log.warning("cache index %s is damaged (%s); moved to %s, starting with an empty cache",
                index_dir, why, dest)


def _build_and_start(cfg: Config, walked: bool,
                     progress: Callable[[int, int, float], None]) -> tuple[Session, dict]:
    """The session, started. An index found damaged while it is opened or recovered (an
    LMDB page error, :func:`integrity.is_damage`; or :class:`IndexDamaged`, what
    recovery cannot recount) is set aside like one the walk refused, and the session built
    again over an empty one: damage costs the cache, never the mount. (A start that skips
    the walk after a clean stop meets such damage here: bits flipped under an unchanged
    file.)"""
    try:
        return _start(build(cfg), progress, walked)
    except Exception as e:
        if not (isinstance(e, IndexDamaged) or integrity.is_damage(e)):
            raise
        _set_aside(cfg.index_dir, str(e) if isinstance(e, IndexDamaged)
                   else f"opening it fails: {type(e).__name__}: {e}")
    return _start(build(cfg), progress, True)


def _start(session: Session, progress: Callable[[int, int, float], None],
           walked: bool) -> tuple[Session, dict]:
    try:
        return session, session.start(progress=progress, recount_all=walked)
    except BaseException:
        session.close_files()
        raise


#: loose entries named in the warning (the count says how many there were)
_SHOWN = 5


def set_cache_modes(cfg: Config, modes: cache_modes.CacheModes) -> None:
    """Give the cache directory (a shared root: the whole root) the modes of ``modes``
    before anything is served, warning of what other users could read or write there
    (tightened, or left with ``--keep-cache-modes``). Blocking; a few hundred entries."""
    # the zero-copy readers' counters: made here with its modes, not by the first reader
    os.makedirs(os.path.join(cfg.data_dir, TALLY_DIR), mode=cache_modes.DIR_MODE,
                exist_ok=True)
    found = cache_modes.enforce(cfg.cache_dir, modes, keep=cfg.keep_cache_modes)
    if found.loose:
        shown = ", ".join(f"{p} {cache_modes.mode_text(m)}" for p, m in found.loose[:_SHOWN])
        more = ", ..." if len(found.loose) > _SHOWN else ""
        done = ("left as they are (--keep-cache-modes)" if cfg.keep_cache_modes
                else f"tightened to {modes.describe()}")
        log.warning("cache directory %s: %d entries could be read or written by other users "
                    "(%s%s); %s", cfg.cache_dir, len(found.loose), shown, more, done)
    if found.failed:
        shown = ", ".join(f"{p}: {why}" for p, why in found.failed[:_SHOWN])
        log.warning("cache directory %s: could not check or set the modes of %d entries "
                    "(%s)", cfg.cache_dir, len(found.failed), shown)
    if found.foreign:
        log.info("cache directory %s: %d entries of other users (or with other links) left "
                 "as they are (%s)", cfg.cache_dir, len(found.foreign),
                 ", ".join(found.foreign[:_SHOWN]))
    if modes.gid is not None:
        log.info("cache directory %s is %s", cfg.cache_dir, modes.describe())
        blocked = cache_modes.unreachable(cfg.cache_dir, modes)
        if blocked is not None:
            log.warning("--reader-group %s: its members cannot reach the cache directory %s: "
                        "%s does not let them search it", modes.group, cfg.cache_dir, blocked)


def _keep_thread_names() -> None:
    """trio renames a worker's OS thread before and after each job (two ``prctl`` calls
    per ``to_thread.run_sync``, each a GIL hand-off in a busy daemon: 2 of the ~15
    syscalls of a fetch); the daemon's threads keep their first names instead (trio
    0.22-0.35 keep the function in this private module global; without it, nothing
    changes)."""
    cache = getattr(getattr(trio, "_core", None), "_thread_cache", None)
    if cache is not None and getattr(cache, "set_os_thread_name", None) is not None:
        cache.set_os_thread_name = None


def run(cfg: Config, report: Reporter) -> int:
    """Run a mount until it is unmounted. ``report`` sends lines to the waiting parent:
    ``progress ...`` while scanning, ``ready`` once mounted, ``error ...`` on failure."""
    lock = CacheLock(cfg.data_dir, cfg.dataset_id,
                     is_mounted=lambda mp: mountctl.is_mounted(mp, fuse=True),
                     wait_for_exit=_wait_stopping)
    session: Session | None = None
    metrics = None
    try:
        modes = cache_modes.reader_group(cfg.reader_group)  # an unknown group: refused
        check_mountpoint(cfg.mountpoint)
        mountctl.check_apart(cfg.source, cfg.mountpoint, cfg.cache_dir)
        ledger.check_root(cfg.cache_dir, cfg.shared_cache, DATASETS_DIR)
        lock.acquire(cfg.mountpoint)
        walked = check_index_or_quarantine(cfg.index_dir)

        def progress(entries: int, dirs: int, elapsed: float) -> None:
            report(f"progress {entries} {dirs} {elapsed:.1f}")

        session, info = _build_and_start(cfg, walked, progress)
        set_cache_modes(cfg, modes)  # the index and the logs' directory exist now
        # walked at this start, or as the last clean stop's walk left it; each commit
        # vouched for after it (readers in training processes map it only then)
        session.engine.index.guard = integrity.hold_sound(
            os.path.join(cfg.data_dir, SOUND_FILE), cfg.index_dir)
        log.info("started: %s", info)
        if cfg.metrics_port:
            # bound before the mount: a port in use fails the mount with the reason
            from dlcachefs.admin.metrics import MetricsServer  # noqa: PLC0415

            try:
                metrics = MetricsServer(cfg.metrics_addr, cfg.metrics_port)
            except OSError as e:
                raise DlcError(f"--metrics-port {cfg.metrics_port} on {cfg.metrics_addr}: "
                               f"{e.strerror}") from e
            log.info("metrics on http://%s:%d/metrics", *metrics.address)

        ops = Operations(session.filesystem())
        pyfuse3.init(ops, cfg.mountpoint, fuse_options(cfg))
    except (DlcError, OSError, RuntimeError, ValueError, ImportError) as e:
        report(f"error {e}")
        log.error("mount failed: %s", e)
        if metrics is not None:
            metrics.close()
        integrity.drop_sound()
        if session is not None:
            session.close_files()
        lock.release()
        return 1
    fuseloop.install()  # a cheaper lock around each wait for a request
    _keep_thread_names()
    clean = False
    try:
        trio.run(_serve, session, ops, report, metrics)
        clean = True
    except Exception:
        # in the log, where a daemonized mount's only trace is (its stderr is /dev/null,
        # and the mount command returned at "ready")
        log.critical("the daemon stops on an unexpected error", exc_info=True)
        raise
    finally:
        if metrics is not None:
            metrics.close()  # before the index closes: no scrape reaches a closed engine
        integrity.drop_sound()
        session.close_files()
        # the index as this stop leaves it: the next start need not walk it (unless an
        # LMDB error while serving hinted at damage, e.g. pages changed under the map)
        if clean and not integrity.damage_seen():
            mark_clean_if_sound(cfg.index_dir)
        lock.release()
        log.info("stopped; index committed")
    return 0


async def _serve(session: Session, ops: Operations, report: Reporter, metrics=None) -> None:
    signalled = stopping = False
    async with trio.open_nursery() as nursery:
        await nursery.start(session.serve)
        if metrics is not None:  # scrapes build the stats on this loop (admin.metrics)
            metrics.attach(session.stats, trio.lowlevel.current_trio_token())
        nursery.start_soon(ops.invalidation_worker)

        async def on_signals() -> None:
            nonlocal signalled
            # What the receiver restores when it closes, and redelivers a signal still
            # pending then to: the daemon is stopping already (by default such a late
            # SIGTERM killed it before its last lines ran). SIG_IGN, not a Python
            # function: the interpreter resets those to SIG_DFL while it shuts down.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
                async for sig in sigs:
                    name = signal.Signals(sig).name
                    if stopping:  # pyfuse3.terminate() after pyfuse3.close() segfaults
                        log.info("got %s while stopping; committing first", name)
                        continue
                    log.info("got %s; unmounting", name)
                    signalled = True
                    pyfuse3.terminate()

        nursery.start_soon(on_signals)

        async def after_init() -> None:
            # the kernel sets the readahead from the INIT reply: raise it only after that
            await ops.initialized.wait()
            await trio.to_thread.run_sync(raise_read_ahead, session.cfg.mountpoint)

        nursery.start_soon(after_init)
        report("ready")
        clean = False
        try:
            await pyfuse3.main(min_tasks=4, max_tasks=64)
            clean = not signalled  # the kernel unmounted us: nothing left to unmount
        finally:
            # The kernel mount goes first (nobody waits on a daemon that no longer
            # answers; after a crash of a task, clients get an error, not ENOTCONN forever);
            # then what is pending is sealed and committed.
            stopping = True
            if metrics is not None:
                metrics.detach()  # scrapes from now on: dlcachefs_up 0
            pyfuse3.close(unmount=not clean)
            with trio.CancelScope(shield=True):
                await session.close()
            nursery.cancel_scope.cancel()
