"""Start DLIO (``dlio_benchmark``) inside its own venv without TensorFlow, and the
raw-read reader used by ``bench.dlio``.

    mpirun -np 2 DLIO_VENV/bin/python -m bench.dlio_launch --config-dir CONF workload=NAME ...

``dlio_benchmark.main`` imports ``dlio_benchmark.profiler.tf_profiler`` at module level,
which imports TensorFlow, although only ``profiler: tf`` ever uses it. The bench installs
DLIO with ``--no-deps`` (no TensorFlow, DALI or a second torch), so this launcher puts a
stand-in for that one module into ``sys.modules`` (its profiler refuses to start) and then
runs DLIO's own ``main()`` with the same command line. Nothing else of DLIO is changed.

``RawImageReader`` is DLIO's ``ImageReader`` without the decode: ``open`` reads the file's
bytes whole (``open(path, "rb").read()``) instead of ``np.asarray(Image.open(path))``.
Select it with ``reader.reader_classname: bench.dlio_launch.RawImageReader``. This module
only imports ``dlio_benchmark`` when run in the DLIO venv; the project's venv never
imports it.
"""

from __future__ import annotations

import sys
import types


def _stub_tf_profiler() -> None:
    """Register a TensorFlow-free ``dlio_benchmark.profiler.tf_profiler``."""
    name = "dlio_benchmark.profiler.tf_profiler"
    if name in sys.modules:
        return
    mod = types.ModuleType(name)

    class TFProfiler:  # the real one subclasses IOProfiler; only its name is imported
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("profiler: tf needs TensorFlow, which the bench's DLIO venv "
                               "does not install")

    mod.TFProfiler = TFProfiler  # type: ignore[attr-defined]
    sys.modules[name] = mod


_stub_tf_profiler()

try:  # only in the DLIO venv
    from dlio_benchmark.reader.image_reader import ImageReader as _ImageReader
except ImportError:  # pragma: no cover - the project's venv has no DLIO
    _ImageReader = object  # type: ignore[assignment,misc]


class RawImageReader(_ImageReader):  # type: ignore[misc,valid-type]
    """DLIO's image reader, minus the decode: every sample is the file's bytes."""

    def open(self, filename: str) -> bytes:  # noqa: A003 - DLIO's method name
        """Read the whole file (what a training script does before decoding)."""
        with open(filename, "rb") as f:
            return f.read()

    def get_sample(self, filename: str, sample_index: int) -> None:
        """Nothing to hand on: DLIO's batches are its own fixed array either way."""
        return None


def main() -> None:
    """Run DLIO's ``main()`` with this process's command line."""
    from dlio_benchmark.main import main as dlio_main

    sys.argv[0] = "dlio_benchmark"
    dlio_main()


if __name__ == "__main__":
    main()
