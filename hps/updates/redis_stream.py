"""The Redis Stream transport of online updates: one stream entry per update record
(``XADD stream * r <record>``); the offset is the entry id, and a stream has one history (no
log id)."""

from __future__ import annotations

import logging
from typing import Any

from hps.updates.record import CorruptRecordError, UpdateBatch, decode_batch, encode_batch
from hps.updates.transport import UpdatePublisher, UpdateSource

__all__ = ["RedisStreamPublisher", "RedisStreamSource", "redis_client"]

log = logging.getLogger("hps.updates")


def redis_client(address: str, cluster: bool) -> Any:
    """A redis-py client for ``"host:port[,host:port]"`` (``RedisCluster`` when ``cluster``).

    Raises:
        ValueError: an address with no ``host:port``, or a port that is not an integer.
    """
    from redis import Redis
    from redis.cluster import ClusterNode, RedisCluster

    nodes = []
    for part in filter(None, (p.strip() for p in address.split(","))):
        host, _, port = part.rpartition(":")
        nodes.append((host, int(port)))
    if not nodes:
        raise ValueError(f"redis address {address!r}: expected 'host:port[,host:port...]'")
    if cluster:
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes])
    return Redis(host=nodes[0][0], port=nodes[0][1])


class RedisStreamPublisher(UpdatePublisher):
    """Publishes each batch as one Redis Stream entry (``XADD stream * r <record>``)."""

    def __init__(self, client: Any, stream: str = "hps_updates") -> None:
        self.client, self.stream = client, stream

    def publish(self, batch: UpdateBatch) -> str:
        rid = self.client.xadd(self.stream, {b"r": encode_batch(batch)})
        return rid.decode() if isinstance(rid, bytes) else str(rid)


class RedisStreamSource(UpdateSource):
    """Reads a Redis Stream after an entry id; a corrupted entry, or one of another record
    format version, stops the reader before it (logging an error naming it)."""

    def __init__(self, client: Any, stream: str = "hps_updates") -> None:
        self.client, self.stream = client, stream
        self.corrupt = 0

    def read(self, offset: str | None, max_records: int = 64) -> list[tuple[str, UpdateBatch]]:
        res = self.client.xread({self.stream: offset or "0-0"}, count=max_records)
        out: list[tuple[str, UpdateBatch]] = []
        for _, entries in res or []:
            for raw_id, fields in entries:
                rid = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
                what = f"update stream {self.stream} entry {rid}"
                try:
                    out.append((rid, decode_batch(fields[b"r"], what)))
                except (CorruptRecordError, KeyError) as e:
                    self.corrupt += 1
                    log.error("update stream %s: entry %s refused: %s", self.stream, rid, e)
                    return out
        return out
