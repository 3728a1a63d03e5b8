"""The health of online updates: how a failing source or a refused record is retried, when it
makes the server not ready, and what the statistics say about it.

A record the applier refuses (:class:`~hps.updates.record.InvalidUpdateError`: an unknown
table, non-finite rows, ...) stays unapplied with every record after it, and so does a record
that cannot be read or written (a corrupt record, a volatile DB that is down). The poller
retries with exponential backoff (:class:`RetryPolicy`): the first retry after the poll
interval, each next one after twice as long, at most ``max_retry_interval_s`` apart, and one
log line per attempt, so a stuck record costs a bounded number of log lines (about
``log2(max / interval)`` plus one per ``max_retry_interval_s``), not one per poll::

    poll interval 0.5 s, max 60 s:  retry after 0.5, 1, 2, 4, 8, 16, 32, 60, 60, ... s

Readiness policy: the server is *not ready* (``/v2/health/ready`` answers 503, gRPC
``ServerReady`` ``false``) once the updates have failed ``unready_after_failures`` attempts in
a row **or** have been failing for ``unready_after_s`` seconds, whichever comes first; it is
ready again after the next attempt that succeeds (or once an operator skipped the refused
record and the records after it applied). Serving itself goes on: a not-ready server answers
lookups from rows that lag the trainer, and the load balancer decides.

An operator skips a refused record explicitly: :meth:`~hps.updates.applier.UpdateApplier.skip`
in process, or ``python -m hps.updates skip --config ps.json --offset OFF [--log-id ID]``
from a shell, which leaves a request file (:func:`skip_request_path`) that the running
poller reads at its next poll. Only the record that is refused now can be skipped, named by
the offset that ends it (as logged and as ``refused_offset`` in the statistics).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hps.config import MIN_RETRY_INTERVAL_S, PSConfig, UpdateSourceConfig
from hps.types import PersistentDBType, UpdateSourceType

__all__ = [
    "RetryPolicy",
    "UpdateHealth",
    "UpdateStatus",
    "skip_request_path",
]

SKIP_SUFFIX = ".skip"


@dataclass(frozen=True)
class RetryPolicy:
    """How failed update attempts are retried and when they make the server not ready.

    Attributes:
        poll_interval_s: seconds between polls while updates apply, and before the first retry.
        max_retry_interval_s: the longest wait between two retries.
        unready_after_failures: not ready after this many failed attempts in a row (>= 1).
        unready_after_s: not ready once the attempts have been failing this long (seconds).
    """

    poll_interval_s: float = 0.5
    max_retry_interval_s: float = 60.0
    unready_after_failures: int = 5
    unready_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.poll_interval_s >= 0:
            raise ValueError(f"poll_interval_s must be >= 0, got {self.poll_interval_s}")
        if not self.max_retry_interval_s >= max(self.poll_interval_s, MIN_RETRY_INTERVAL_S):
            raise ValueError(
                f"max_retry_interval_s must be >= poll_interval_s ({self.poll_interval_s}) "
                f"and >= {MIN_RETRY_INTERVAL_S}, got {self.max_retry_interval_s}"
            )
        if isinstance(self.unready_after_failures, bool) or self.unready_after_failures < 1:
            raise ValueError(
                f"unready_after_failures must be an integer >= 1, got {self.unready_after_failures}"
            )
        if not self.unready_after_s > 0:
            raise ValueError(f"unready_after_s must be > 0 seconds, got {self.unready_after_s}")

    @staticmethod
    def of(cfg: UpdateSourceConfig) -> RetryPolicy:
        """The policy ``ps.json``'s ``update_source`` asks for."""
        return RetryPolicy(
            cfg.poll_interval_s,
            cfg.max_retry_interval_s,
            cfg.unready_after_failures,
            cfg.unready_after_s,
        )

    def retry_after_s(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed attempt in a row (>= 1)."""
        first = max(self.poll_interval_s, MIN_RETRY_INTERVAL_S)
        return min(self.max_retry_interval_s, first * 2.0 ** min(failures - 1, 64))


@dataclass(frozen=True)
class UpdateStatus:
    """A snapshot of the online updates' health (``/v2/models/{m}/stats`` shows it as
    ``"online_updates"``).

    Attributes:
        ready: whether the readiness policy holds (:class:`RetryPolicy`).
        reason: why not ready (``""`` when ready).
        failures: failed attempts in a row (0 while updates apply).
        failing_for_s: seconds since the first of them (0 while updates apply).
        last_error: the last attempt's error (``""`` after a success).
        refused_offset: the offset that ends the record refused now (``None``: none is), the
            one :meth:`~hps.updates.applier.UpdateApplier.skip` takes.
        refused_log_id: the id of the log that record is in (``None`` for a Redis stream).
        retry_in_s: seconds to the next attempt (0 while updates apply).
        applied: records applied since the server started.
        skipped: records an operator skipped since the server started.
    """

    ready: bool = True
    reason: str = ""
    failures: int = 0
    failing_for_s: float = 0.0
    last_error: str = ""
    refused_offset: str | None = None
    refused_log_id: str | None = None
    retry_in_s: float = 0.0
    applied: int = 0
    skipped: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class UpdateHealth:
    """The running count of failed update attempts and the refused record, shared by the
    poller (which writes it) and the servers (which read :meth:`status`). Thread-safe.

    Args:
        policy: the retry and readiness policy.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self, policy: RetryPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy or RetryPolicy()
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._since = 0.0
        self._next_at = 0.0
        self._error = ""
        self._refused: tuple[str, str | None] | None = None
        self._applied = 0
        self._skipped = 0

    def succeeded(self, applied: int) -> bool:
        """Record an attempt that applied ``applied`` records (perhaps 0) without an error;
        returns whether it ended a run of failures."""
        with self._lock:
            ended = self._failures > 0
            self._failures, self._error, self._refused = 0, "", None
            self._next_at = 0.0
            self._applied += applied
            return ended

    def failed(self, error: BaseException, applied: int = 0) -> float:
        """Record a failed attempt (after ``applied`` records it did apply); returns the
        seconds to wait before the next one."""
        with self._lock:
            now = self._clock()
            if self._failures == 0:
                self._since = now
            self._failures += 1
            self._applied += applied
            self._error = str(error)
            delay = self.policy.retry_after_s(self._failures)
            self._next_at = now + delay
            return delay

    def refused(self, offset: str, log_id: str | None) -> None:
        """Note the record ending at ``offset`` (in log ``log_id``) as the one refused now."""
        with self._lock:
            self._refused = (offset, log_id)

    def refused_record(self) -> tuple[str, str | None] | None:
        """``(offset, log id)`` of the record refused now, or ``None``."""
        with self._lock:
            return self._refused

    def skipped(self) -> None:
        """Record that an operator skipped the refused record: the next attempt is due now."""
        with self._lock:
            self._refused = None
            self._skipped += 1
            self._next_at = 0.0

    def due(self) -> bool:
        """Whether the next attempt is due (its backoff has passed)."""
        with self._lock:
            return self._clock() >= self._next_at

    @property
    def failures(self) -> int:
        """Failed attempts in a row."""
        with self._lock:
            return self._failures

    def status(self) -> UpdateStatus:
        """A snapshot, with the readiness policy applied."""
        with self._lock:
            now = self._clock()
            p = self.policy
            failing_for = now - self._since if self._failures else 0.0
            reason = ""
            if self._failures >= p.unready_after_failures:
                reason = f"online updates failed {self._failures} attempts in a row"
            elif self._failures and failing_for >= p.unready_after_s:
                reason = f"online updates have been failing for {failing_for:.0f} s"
            if reason:
                reason += f" (policy: not ready after {p.unready_after_failures} failures or "
                reason += f"{p.unready_after_s:g} s): {self._error}"
            off, lid = self._refused if self._refused is not None else (None, None)
            return UpdateStatus(
                ready=not reason,
                reason=reason,
                failures=self._failures,
                failing_for_s=failing_for,
                last_error=self._error,
                refused_offset=off,
                refused_log_id=lid,
                retry_in_s=max(0.0, self._next_at - now) if self._failures else 0.0,
                applied=self._applied,
                skipped=self._skipped,
            )


def skip_request_path(cfg: PSConfig) -> Path | None:
    """Where ``python -m hps.updates skip`` leaves its request for the running poller:
    ``<update log>.skip`` for a file log; for a Redis stream ``<state_path>.skip``, or
    ``<persistent_db.path>.skip`` when the persistent DB keeps the offset. ``None`` without
    online updates."""
    u = cfg.update_source
    if u.type is UpdateSourceType.NONE:
        return None
    if u.type is UpdateSourceType.FILE_LOG:
        return Path(u.path + SKIP_SUFFIX)
    if u.state_path:
        return Path(u.state_path + SKIP_SUFFIX)
    if cfg.persistent_db.type is PersistentDBType.ROCKS_DB:
        return Path(cfg.persistent_db.path.rstrip("/") + SKIP_SUFFIX)
    return None
