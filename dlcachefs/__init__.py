"""dlcachefs: a read-only FUSE mirror of a slow dataset directory, cached in chunk logs.

The core (this package) is free of FUSE: it can be driven directly from tests. The FUSE
adapter lives in :mod:`dlcachefs.mount`, caching policies in :mod:`dlcachefs.policies`.
"""

__version__ = "0.1.0"
