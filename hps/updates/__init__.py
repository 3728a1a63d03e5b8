"""Online updates: the trainer publishes the embedding rows it changed; every server applies
them to its volatile DB, persistent DB and cached copies, resuming after the last applied
offset.

- :mod:`hps.updates.record`: the versioned, checksummed record of one update batch.
- :mod:`hps.updates.transport`: the publisher and source interfaces.
- :mod:`hps.updates.file_log`: the append-only update log (a versioned log header with the
  log's id, then records), the embedded transport.
- :mod:`hps.updates.redis_stream`: the Redis Stream transport.
- :mod:`hps.updates.applier`: applying batches atomically and storing the offset.
- :mod:`hps.updates.health`: retrying failures with bounded backoff, the readiness policy, the
  status the servers show, skipping a refused record (``python -m hps.updates skip``).
- :mod:`hps.updates.trainer_callback`: the training callback that publishes changed rows.
"""

from hps.updates.applier import OffsetFile, UpdateApplier
from hps.updates.file_log import (
    FileLogPublisher,
    FileLogSource,
    LogReplacedError,
    OffsetPastEndError,
    StaleOffsetError,
)
from hps.updates.health import RetryPolicy, UpdateHealth, UpdateStatus
from hps.updates.record import (
    CorruptRecordError,
    InvalidUpdateError,
    RecordVersionError,
    UpdateBatch,
    decode_batch,
    encode_batch,
)
from hps.updates.redis_stream import RedisStreamPublisher, RedisStreamSource, redis_client
from hps.updates.trainer_callback import PublishUpdatesCallback
from hps.updates.transport import UpdatePublisher, UpdateSource

__all__ = [
    "CorruptRecordError",
    "FileLogPublisher",
    "FileLogSource",
    "InvalidUpdateError",
    "LogReplacedError",
    "OffsetFile",
    "OffsetPastEndError",
    "PublishUpdatesCallback",
    "RecordVersionError",
    "RedisStreamPublisher",
    "RedisStreamSource",
    "RetryPolicy",
    "StaleOffsetError",
    "UpdateApplier",
    "UpdateBatch",
    "UpdateHealth",
    "UpdatePublisher",
    "UpdateSource",
    "UpdateStatus",
    "decode_batch",
    "encode_batch",
    "redis_client",
]
