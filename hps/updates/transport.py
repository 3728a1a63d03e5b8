"""The two ends of an update transport: a publisher appends records, a source reads them back
after an *offset* (a string that means something only to its transport: a byte position in a
file log, an entry id in a Redis stream)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from hps.updates.record import UpdateBatch

__all__ = ["UpdatePublisher", "UpdateSource"]


class UpdatePublisher(ABC):
    """Appends update batches to a transport (the trainer's end)."""

    @abstractmethod
    def publish(self, batch: UpdateBatch) -> str:
        """Append one batch; returns its offset (as a string)."""


class UpdateSource(ABC):
    """Reads update batches from a transport (every server's end)."""

    @abstractmethod
    def read(self, offset: str | None, max_records: int) -> list[tuple[str, UpdateBatch]]:
        """Records after ``offset`` (``None`` = from the start): ``[(offset after it, batch)]``."""

    def read_log(
        self, offset: str | None, log_id: str | None, max_records: int = 64
    ) -> tuple[str | None, list[tuple[str, UpdateBatch]]]:
        """:meth:`read`, for a source whose offsets mean something only within one log: checks
        that ``offset`` was taken in the log ``log_id`` and returns ``(the log's id, records)``.
        This default (a source with one history, e.g. a Redis stream) has no log id: ``None``."""
        return None, self.read(offset, max_records)

    def check_offset(self, offset: str, log_id: str | None) -> None:
        """Raise ``ValueError`` (saying why) unless ``offset`` (taken in the log ``log_id``) is
        a well-formed position for this source. This default, a source with one history,
        accepts any offset (the source itself refuses a bad one) and no log id."""
        if log_id is not None:
            raise ValueError(
                f"{type(self).__name__} has one history and no log ids; got log id {log_id!r}"
            )
