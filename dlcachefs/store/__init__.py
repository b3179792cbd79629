"""The cache directory on disk: chunk format, log files, LMDB schema and index, the cache
lock, offline verification. Blocking code only: no trio, no knowledge of reads or policies."""
