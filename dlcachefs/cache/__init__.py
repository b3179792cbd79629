"""Serving files: the engine (open/read/release), the source and its namespace, the memory
tier, the chunk writer, read plans, scan-ahead, and the contract caching policies implement."""
