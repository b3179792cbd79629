"""The FUSE front-end: the only part of dlcachefs that imports pyfuse3.

A thin adapter: each operation converts arguments, awaits the core, builds
``EntryAttributes``, and lets :mod:`.errmap` turn the core's exceptions into errno.
"""
