"""A stuck online update (a refused record): retried with bounded exponential backoff and one
log line per attempt, not one per poll; shown in the statistics; the server not ready after N
failures or T seconds; skipped by an operator only when named (API, request file, CLI)."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from hps.config import load_config
from hps.session import LookupSession, SessionTable
from hps.storage.volatile import HashMapBackend
from hps.updates import FileLogPublisher, FileLogSource, UpdateApplier, encode_batch
from hps.updates.__main__ import main as updates_cli
from hps.updates.health import RetryPolicy, UpdateHealth, skip_request_path

DIM = 3


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _append_nan_record(log: Path, key: int) -> None:
    """A record a foreign publisher wrote (our publisher refuses it): a NaN row for ``key``."""
    nan = np.full((1, DIM), 1.0, np.float32)
    nan[0, 1] = np.nan
    payload = encode_batch({"t": (np.array([key], np.int64), np.ones((1, DIM), np.float32))})[17:]
    payload = payload[: -4 * DIM] + nan.tobytes()
    with open(log, "ab") as f:
        f.write(struct.pack("<4sBQI", b"HPSU", 1, len(payload), zlib.crc32(payload)) + payload)


def _row(key: int, value: float) -> dict:
    return {"t": (np.array([key], np.int64), np.full((1, DIM), value, np.float32))}


def test_backoff_schedule_and_readiness_policy() -> None:
    p = RetryPolicy(poll_interval_s=0.5, max_retry_interval_s=60, unready_after_failures=5)
    assert [p.retry_after_s(k) for k in range(1, 11)] == [0.5, 1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert RetryPolicy(poll_interval_s=0).retry_after_s(1) == 0.05  # never a busy loop
    clock = FakeClock()
    h = UpdateHealth(p, clock=clock)
    for k in range(1, 6):
        assert h.status().ready, k
        h.failed(ValueError("boom"))
    st = h.status()
    assert not st.ready and st.failures == 5
    assert "failed 5 attempts in a row (policy: not ready after 5 failures or 60 s): boom" in (
        st.reason
    )
    assert h.succeeded(1) and h.status().ready and h.status().applied == 1
    # the time limit: one failure, then 60 s of it
    h = UpdateHealth(RetryPolicy(unready_after_failures=100, unready_after_s=60), clock=clock)
    h.failed(ValueError("down"))
    clock.t += 59.9
    assert h.status().ready
    clock.t += 0.1
    assert not h.status().ready and "failing for 60 s" in h.status().reason
    for bad in (
        {"unready_after_failures": 0},
        {"unready_after_s": 0},
        {"poll_interval_s": 2, "max_retry_interval_s": 1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)


def test_a_stuck_record_backs_off_and_is_skipped_only_when_named(tmp_path: Path, caplog) -> None:
    """20 s of polls every 0.05 s (400 polls) over a refused record: 9 attempts, each logged
    once (0, 0.05, 0.15, 0.35, 0.75, 1.55, 3.15, 6.35, 12.75 s); not ready from the 5th; a
    skip request naming another record is refused, the named one is skipped and the records
    after it apply."""
    vdb = HashMapBackend(num_partitions=1)
    vdb.create_table("t", DIM)
    clock = FakeClock()
    health = UpdateHealth(RetryPolicy(poll_interval_s=0.05), clock=clock)
    s = LookupSession([SessionTable("t", DIM, 0.0, 100)], vdb, update_health=health)
    log = tmp_path / "u.log"
    pub = FileLogPublisher(log)
    pub.publish(_row(1, 2.0))
    _append_nan_record(log, 3)
    bad_end = str(log.stat().st_size)
    pub.publish(_row(5, 7.0))
    skip_file = tmp_path / "u.log.skip"
    ap = UpdateApplier(
        FileLogSource(log), [s], vdb, offset_file=tmp_path / "off", health=health,
        skip_request=skip_file,
    )  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="hps.updates"):
        for i in range(400):  # what the poller thread does at each tick
            clock.t = i * 0.05
            ap.take_skip_request()
            if health.due():
                ap.attempt()
    lines = [r.getMessage() for r in caplog.records if "applying online updates failed" in r.msg]
    assert len(lines) == 9, lines
    assert "attempt 9 in a row; next in 12.8 s" in lines[-1] and "non-finite" in lines[-1]
    st = s.update_status()
    assert not st.ready and st.failures == 9 and st.applied == 1
    assert (st.refused_offset, st.refused_log_id) == (bad_end, ap.log_id)
    assert np.array_equal(vdb.lookup("t", np.array([1, 5]))[0][:, 0], [2.0, 0.0])

    with pytest.raises(ValueError, match=rf"the refused record ends at offset '{bad_end}'"):
        ap.skip("17", st.refused_log_id)
    skip_file.write_text(f"17 {st.refused_log_id}")  # names another record: not followed
    with caplog.at_level(logging.ERROR, logger="hps.updates"):
        assert not ap.take_skip_request()
    assert "not followed" in caplog.records[-1].getMessage() and not skip_file.exists()
    skip_file.write_text(f"{bad_end} {st.refused_log_id}")
    assert ap.take_skip_request() and not skip_file.exists()
    assert health.due() and ap.attempt() == 1
    st = s.update_status()
    assert st.ready and st.failures == 0 and st.skipped == 1 and st.refused_offset is None
    assert np.array_equal(vdb.lookup("t", np.array([1, 3, 5]))[0][:, 0], [2.0, 0.0, 7.0])
    with pytest.raises(ValueError, match="no record is refused now"):
        ap.skip(bad_end, st.refused_log_id)
    s.close()


def _doc(**updates: object) -> dict:
    return {
        "update_source": {"type": "file_log", "path": "u.log", **updates},
        "models": [
            {
                "model": "m",
                "sparse_files": ["sparse/t"],
                "embedding_table_names": ["t"],
                "embedding_vecsize_per_table": [DIM],
                "maxnum_catfeature_query_per_table_per_sample": [1],
            }
        ],
    }


def test_ps_json_carries_the_policy_and_refuses_impossible_values(tmp_path: Path) -> None:
    (tmp_path / "ps.json").write_text(
        json.dumps(_doc(max_retry_interval_s=5, unready_after_failures=3, unready_after_s=9))
    )
    cfg = load_config(tmp_path / "ps.json")
    assert RetryPolicy.of(cfg.update_source) == RetryPolicy(0.5, 5.0, 3, 9.0)
    assert skip_request_path(cfg) == tmp_path / "u.log.skip"
    (tmp_path / "ps.json").write_text(
        json.dumps(_doc(poll_interval_s=2, max_retry_interval_s=1, unready_after_failures=0))
    )
    with pytest.raises(ValueError) as e:
        load_config(tmp_path / "ps.json")
    assert "update_source.max_retry_interval_s: 1.0 is impossible" in str(e.value)
    assert "update_source.unready_after_failures: 0 is impossible" in str(e.value)


def test_the_skip_cli_refuses_a_ps_json_without_updates(tmp_path: Path, capsys) -> None:
    doc = _doc()
    del doc["update_source"]
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        updates_cli(["skip", "--config", str(tmp_path / "ps.json"), "--offset", "9"])
    assert e.value.code == 2 and "no place for a skip request" in capsys.readouterr().err
