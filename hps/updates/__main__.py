"""``python -m hps.updates skip --config ps.json --offset OFF [--log-id ID]``: ask the running
server's online-update poller to skip the record it refuses now (:mod:`hps.updates.health`).

The request is a small file beside the update state (:func:`hps.updates.health.skip_request_path`)
that the poller reads at its next poll; it skips the record only if ``--offset`` (and
``--log-id`` for a file log) name the record refused then, as its log line and the
``online_updates`` statistics show, and logs what it did. A ``ps.json`` without online updates,
or whose updates have no place for the request, ends with exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from hps.config import load_config
from hps.updates.applier import OffsetFile
from hps.updates.health import skip_request_path
from knobs import add_knobs, from_namespace, knob


@dataclass(frozen=True)
class SkipKnobs:
    """The knobs of ``python -m hps.updates skip`` (shown in ``--help``)."""

    config: str = knob("ps.json", "the server's ps.json", required=True)
    offset: str = knob("", "the offset that ends the refused record (its log line)", required=True)
    log_id: str | None = knob(None, "the update log's id (a file log)", parse=str)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hps.updates",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    skip = sub.add_parser("skip", help="skip the update record the server refuses now")
    add_knobs(skip, SkipKnobs)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = from_namespace(SkipKnobs, p.parse_args(argv))
    try:
        cfg = load_config(a.config)
    except (ValueError, OSError) as e:
        p.error(str(e))
    path = skip_request_path(cfg)
    if path is None:
        p.error(f"{a.config}: update_source has no place for a skip request (no online updates)")
    if len(a.offset.split()) != 1 or (a.log_id is not None and len(a.log_id.split()) != 1):
        p.error(f"--offset {a.offset!r} and --log-id {a.log_id!r} must be single words")
    OffsetFile(path).save(a.offset, a.log_id)
    print(f"asked the update poller to skip the record ending at offset {a.offset}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
