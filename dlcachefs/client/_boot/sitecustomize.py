"""Put on PYTHONPATH by ``dlcachefs run``: installs the dlcachefs torch hook in every
Python process of the training (nothing is imported until torch is)."""

try:
    from dlcachefs.torch import install as _dlcachefs_install

    _dlcachefs_install()
except Exception as _e:  # noqa: BLE001 - a broken hook must never stop the program
    import sys

    print(f"dlcachefs: sampler hook not installed: {_e}", file=sys.stderr)
