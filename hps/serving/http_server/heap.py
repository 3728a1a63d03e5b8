"""The interpreter's objects frozen while a v2 server serves (``ServerConfig.gc_freeze``).

CPython's cyclic collector walks every object of the generations it collects, all of them in
a full collection, holding the interpreter lock that the event loop, the gRPC servicer and
each model's inference thread need. A serving process holds a few hundred thousand tracked
objects from its imports and models (206k in ``python -m hps.server`` for the tiny model,
477k in ``bench_server``'s process, which also holds the model), while every request
allocates containers that trigger collections. Unfrozen, tiny model, 16 HTTP clients × batch
16 on 2 shared cores, a full collection stopped the server for 346-347 ms in each 20 s cell;
in a server-only process one takes 125-197 ms (docs/benchmarks.md, "v2 server: the
collector's walk over the start-up heap").

:func:`freeze` collects the start-up's garbage once, then moves every object tracked when a
server starts into the collector's permanent generation (``gc.freeze``), which collections
skip; what is allocated while serving is collected as before. The collection costs one walk
of the heap at each start (125-197 ms in a server-only process). An object alive at start
that turns into cyclic garbage later is kept until the last server of the process stops
(:func:`thaw`, ``gc.unfreeze``): a bound fixed at start, which requests served do not grow.
"""

from __future__ import annotations

import atexit
import gc
import threading

__all__ = ["freeze", "frozen_servers", "thaw"]

_lock = threading.Lock()
_servers = 0  # servers of this process that froze the heap and have not stopped
_exit_hook = False  # _thaw_at_exit registered


def freeze() -> None:
    """Collect the garbage of the start-up (one full collection), then freeze every object
    tracked (``gc.freeze``), for one more running server. Collected first, the start-up's
    cyclic garbage (an exception's traceback holding a frame's arrays, say) is freed now rather
    than kept frozen until the last server stops."""
    global _servers, _exit_hook
    with _lock:
        if not _exit_hook:
            atexit.register(_thaw_at_exit)
            _exit_hook = True
        gc.collect()
        gc.freeze()
        _servers += 1


def _thaw_at_exit() -> None:
    """At interpreter exit, the objects of servers never stopped are unfrozen first. Frozen,
    the event loop of a server still running outlived the interpreter's finalization, and its
    next timer (uvloop's, in the server's daemon thread) called into the finalized
    interpreter: SIGSEGV at exit (CPython 3.11, uvloop 0.23)."""
    global _servers
    with _lock:
        if _servers:
            _servers = 0
            gc.unfreeze()


def thaw() -> None:
    """One server that froze the heap stopped; the last one returns the frozen objects to the
    oldest generation (``gc.unfreeze``), so they are collected again.

    Raises:
        RuntimeError: no server holds the heap frozen.
    """
    global _servers
    with _lock:
        if _servers == 0:
            raise RuntimeError("thaw() without a freeze(): no server holds the heap frozen")
        _servers -= 1
        if _servers == 0:
            gc.unfreeze()


def frozen_servers() -> int:
    """How many running servers of this process hold the heap frozen."""
    with _lock:
        return _servers
