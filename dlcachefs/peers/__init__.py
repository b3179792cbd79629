"""The cluster's shared peer tier (``--peers``): memcached servers, one per node, that
hold the files each node read from the source, keyed by content, so each file leaves the
remote once per cluster. ``valuefmt`` (content keys, the checked value format; pure),
``servers`` (pymemcache clients: routing by rendezvous hash, blocking calls), ``tier``
(the mount's use of it on the trio loop: lookups, leases, background stores, servers
marked down, stats). pymemcache is imported only when a mount has ``--peers``."""
