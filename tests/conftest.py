from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dlcachefs.testing.mounting import DaemonOracle, Mount, record_problems  # noqa: E402


def _fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


requires_fuse = pytest.mark.skipif(not _fuse_available(), reason="needs /dev/fuse and fusermount3")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "daemon_log_allows(*regexes): problems (WARNING/ERROR records, tracebacks) "
        "the test's daemons, and the core it runs in this process, may log; each regex is "
        "searched in one problem (see mounting.log_problems and mounting.record_problems). "
        "Keep them narrow and say why.")
    config.addinivalue_line(
        "markers", "verify_allows(*regexes): what 'dlcachefs verify' may report on the test's "
        "caches after it (a test that damages a cache on purpose; see mounting.verify_problems)")


def _allows(request, marker: str) -> list[str]:
    return [a for m in request.node.iter_markers(marker) for a in m.args]


class _Records(logging.Handler):
    """Keeps the records of WARNING and above logged under ``dlcachefs`` in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def log_oracle(request):
    """Every tier: the test fails when the core, run in this process, logs a WARNING, an
    ERROR or a traceback under ``dlcachefs`` that the test's ``daemon_log_allows``
    regexes (the mounted tests' vocabulary) do not allow (mounting.record_problems). A
    handler of its own on the ``dlcachefs`` logger: ``caplog`` stays the tests' own."""
    handler = _Records()
    logger = logging.getLogger("dlcachefs")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
    problems = record_problems(handler.records, _allows(request, "daemon_log_allows"))
    assert not problems, ("the core logged problems the test does not expect (allow them "
                          "with daemon_log_allows if they are the point of the test):\n"
                          + "\n".join(problems[:30]))


@pytest.fixture
def daemon_oracle(request):
    """A :class:`DaemonOracle` with this test's ``daemon_log_allows`` and ``verify_allows``;
    at teardown (after the ``mount`` fixture has stopped its daemons) the test fails if a
    watched daemon did not end well, a watched daemon log holds an unexpected problem or
    ``dlcachefs verify`` finds one in a watched cache. Tests that run daemons by other
    means ``watch()`` their log and cache."""
    oracle = DaemonOracle(_allows(request, "daemon_log_allows"), _allows(request, "verify_allows"))
    yield oracle
    problems = oracle.problems()
    assert not problems, ("the daemons, their logs or their caches show problems the test "
                          "does not expect:\n" + "\n".join(problems[:30]))


@pytest.fixture
def mount(tmp_path, daemon_oracle):
    """Factory: mount(source, *extra_args, name='mnt', cache=None, mnt=None, log=None) ->
    started Mount (mountpoint tmp_path/name unless ``mnt``; see :class:`Mount` for ``log``).
    Every mount made here is unmounted at teardown, even when the test failed. Mounts run
    with ``--debug-invariants``; after the test (and the unmount, whose final commit is
    checked too) :func:`daemon_oracle` checks how each daemon ended, reads its log (an
    invariant violation is an ERROR line) and runs ``dlcachefs verify`` on its cache."""
    made: list[Mount] = []

    def make(source: Path, *extra: str, name: str = "mnt", cache: Path | None = None,
             mnt: Path | None = None, log: Path | None = None) -> Mount:
        m = Mount(Path(source), mnt or tmp_path / name, cache or tmp_path / "cache", *extra,
                  log=log)
        made.append(m)
        daemon_oracle.watch(mount=m)
        return m.start()

    yield make
    for m in made:
        m.cleanup()
