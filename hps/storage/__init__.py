"""Storage tiers of the parameter server: embedding cache, volatile DBs (in-process hash map,
Redis cluster), the persistent DB (RocksDB) and the sparse-file format they load from."""
