"""``bench_server``'s clock of the cyclic collector (``server_gc_*`` in each concurrency row)
counts the collections run while it is entered, and only those."""

from __future__ import annotations

import gc

from benchmarks.hps.server_concurrency import GcClock


def test_the_clock_counts_the_collections_inside_it_and_leaves_no_callback() -> None:
    with GcClock() as g:
        gc.collect()  # one full collection
        gc.collect(0)  # one young one
    assert g.runs[2] >= 1 and g.runs[0] >= 1
    assert g.seconds > 0 and 0 < g.longest_s <= g.seconds
    assert g._on_gc not in gc.callbacks
    before = list(g.runs)
    gc.collect()
    assert g.runs == before  # a collection after the block is not counted
