"""Offline replay of access traces against the caching policies (``dlcachefs simulate``),
with the Belady and LRU references, and the trace recorder a mount writes."""
