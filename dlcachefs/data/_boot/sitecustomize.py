"""Put on PYTHONPATH by ``dlcachefs run``: installs the dlcachefs torch hook in every
Python process of the training (the samplers are patched when torch is imported; at
start, a background thread opens the control file of the mounts the training will read,
so their sampler replay workers import torch meanwhile), and serves opens of cached files
in the process (:mod:`dlcachefs.data.intercept`, unless ``DLCACHEFS_INTERCEPT=0``)."""

try:
    from dlcachefs.data.hook import install as _dlcachefs_install

    _dlcachefs_install()
except Exception as _e:  # noqa: BLE001 - a broken hook must never stop the program
    import sys

    print(f"dlcachefs: sampler hook not installed: {_e}", file=sys.stderr)

try:
    from dlcachefs.data.intercept import install as _dlcachefs_intercept

    _dlcachefs_intercept()
except Exception as _e:  # noqa: BLE001 - reads then go through the mount, as without it
    import sys

    print(f"dlcachefs: in-process reads not installed: {_e}", file=sys.stderr)
