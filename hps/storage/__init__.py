"""The storage tiers of the parameter server and the files they load from.

- :mod:`hps.storage.cache`: the embedding cache (set-associative, LRU or LFU with aging),
  rows as torch tensors on the compute device.
- :mod:`hps.storage.volatile`: the in-process volatile DB, a partitioned hash map; each
  partition's pool and key index (direct, sorted uint32 or sorted int64 keys, by the density
  of the keys: :class:`KeyLayout`) in :mod:`hps.storage.hash_partition`.
- :mod:`hps.storage.redis_cluster`: the volatile DB on a Redis cluster (survives outages:
  reads it cannot answer fail, never "not found", and fall through or are refused; writes
  are queued and replayed; each partition carries a mark that a node restarted empty lacks).
- :mod:`hps.storage.persistent`: the persistent DB on RocksDB, every row of every table.
- :mod:`hps.storage.sparse_files`: HugeCTR's sparse-file layout (and a safetensors variant).

The DBs implement :class:`hps.types.StorageBackend` (batched ``lookup`` / ``read`` /
``insert`` on ``(n,) int64`` keys and ``(n, dim) float32`` rows).
"""

from hps.storage.cache import CacheStats, EmbeddingCache
from hps.storage.hash_partition import KeyLayout
from hps.storage.persistent import RocksDBBackend
from hps.storage.redis_cluster import RedisClusterBackend
from hps.storage.sparse_files import (
    SparseFormat,
    convert_checkpoint,
    detect_format,
    read_table,
    write_table,
)
from hps.storage.volatile import HashMapBackend
from hps.types import StorageBackend

__all__ = [
    "CacheStats",
    "EmbeddingCache",
    "HashMapBackend",
    "KeyLayout",
    "RedisClusterBackend",
    "RocksDBBackend",
    "SparseFormat",
    "StorageBackend",
    "convert_checkpoint",
    "detect_format",
    "read_table",
    "write_table",
]
