"""Lookup sessions: one model's tables served through cache → volatile DB → persistent DB →
the table's default vector.

- :mod:`hps.session.lookup`: :class:`LookupSession` (the public API, its lookup path and
  cache maintenance) and :class:`SessionTable`; the module docstring walks one lookup.
- :mod:`hps.session.tiers`: reading rows through the database tiers, and refusing a key no
  tier could read.
- :mod:`hps.session.fill`: what cache misses get (the fill policy) and the background cache jobs.

Its statistics are :mod:`hps.session_stats`; its fused multi-table lookup :mod:`hps.session.fused`.
"""

from hps.session.lookup import (
    DEFAULT_KEY_STATS_SAMPLING,
    LookupSession,
    SessionTable,
    unique_with_inverse,
)

__all__ = ["DEFAULT_KEY_STATS_SAMPLING", "LookupSession", "SessionTable", "unique_with_inverse"]
