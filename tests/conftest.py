from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mounting import Mount  # noqa: E402


def _fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


requires_fuse = pytest.mark.skipif(not _fuse_available(), reason="needs /dev/fuse and fusermount3")


@pytest.fixture
def mount(tmp_path):
    """Factory: mount(source, *extra_args, name='mnt', cache=None) -> started Mount.
    Every mount made here is unmounted at teardown, even when the test failed. Mounts run
    with ``--debug-invariants``; after the test (and the unmount, whose final commit is
    checked too) the test fails if any daemon logged an invariant violation."""
    made: list[Mount] = []

    def make(source: Path, *extra: str, name: str = "mnt", cache: Path | None = None) -> Mount:
        m = Mount(Path(source), tmp_path / name, cache or tmp_path / "cache", *extra)
        made.append(m)
        return m.start()

    yield make
    for m in made:
        m.cleanup()
    problems = [v for log in dict.fromkeys(m.log for m in made)
                for v in Mount.violations_in(log)]
    assert not problems, "--debug-invariants found violations:\n" + "\n".join(problems[:20])
