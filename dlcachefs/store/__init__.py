"""The cache directory on disk: chunk format, log files, LMDB schema and index, the seal
transaction that indexes new chunks, the cache lock, offline verification. Blocking code
only: no trio, no knowledge of reads or policies."""
