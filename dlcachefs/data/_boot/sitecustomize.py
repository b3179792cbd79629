"""Put on PYTHONPATH by ``dlcachefs run``: installs the dlcachefs torch hook in every
Python process of the training (the samplers are patched when torch is imported; at
start, a background thread opens the control file of the mounts the training will read,
so their sampler replay workers import torch meanwhile)."""

try:
    from dlcachefs.data.hook import install as _dlcachefs_install

    _dlcachefs_install()
except Exception as _e:  # noqa: BLE001 - a broken hook must never stop the program
    import sys

    print(f"dlcachefs: sampler hook not installed: {_e}", file=sys.stderr)
