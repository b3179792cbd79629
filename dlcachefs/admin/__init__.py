"""Operating a mount from outside: warm-up, metrics, the live view, loader-worker advice.

What runs in the CLI (``warmup``, ``top``, ``advise``, ``dlcachedir``) talks to a mount only
through its files (``.dlcache/stats``, ``.dlcache/zerocopy``, the mirrored files) and
never imports trio; ``metrics`` runs inside the daemon (see its module doc).
"""
