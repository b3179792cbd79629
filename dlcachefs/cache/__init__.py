"""Serving files: the engine (open/read/release, and the wiring of the rest), the source and
the one wrapper every source call goes through (fetch), the namespace, the freshness check
(versions), the reader of the memory tier and the logs, the in-memory buffers, the chunk
writer, prefetch, read plans, scan-ahead, substitution, recovery, invariants, and the
contract caching policies implement."""
