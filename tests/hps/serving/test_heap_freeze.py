"""A running v2 server keeps the objects of its process's start out of the cyclic collector's
walks (``ServerConfig.gc_freeze``, :mod:`hps.serving.http_server.heap`): the start-up's
garbage collected, the rest frozen from its start to the stop of the last server that froze
them, what is made during serving collected as before; a process that exits with a server
still running exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from embark.models.dlrm import DLRM
from hps.server import ServerKnobs, build_parser
from hps.serving.http_server import ServerConfig
from knobs import from_namespace
from tests.hps.serving.tiny_dlrm import ROOT, tiny_model, write_artifacts


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model: DLRM = tiny_model()
    return write_artifacts(model, tmp_path_factory.mktemp("heap")) / "ps.json"


# Run in a process of its own: the collector's frozen generation is process-wide, and other
# tests' servers may hold it frozen in pytest's process.
_LIFECYCLE = textwrap.dedent(
    """
    import gc, sys, weakref
    from hps.parameter_server import HierarchicalParameterServer
    from hps.serving.http_server import InferenceServer, ServerConfig, heap

    class Node:
        pass

    def cycle():
        n = Node()
        n.me = n  # only the cyclic collector can free it
        return n, weakref.ref(n)

    ps = HierarchicalParameterServer.from_config(sys.argv[1])
    assert heap.frozen_servers() == 0 and gc.get_freeze_count() == 0
    kept, at_start = cycle()
    gc.disable()  # no automatic collection: only the server's start can free this garbage
    start_garbage = cycle()[1]
    a = InferenceServer(ps, ServerConfig(port=0)).start()
    gc.enable()
    assert start_garbage() is None, "the start-up's garbage was frozen, not collected"
    assert heap.frozen_servers() == 1 and gc.get_freeze_count() > 0
    del kept
    gc.collect()
    assert at_start() is not None, "an object of the start was walked by the collector"
    made, while_serving = cycle()
    del made
    gc.collect()
    assert while_serving() is None, "garbage made while serving was not collected"
    b = InferenceServer(ps, ServerConfig(port=0, gc_freeze=False)).start()
    assert heap.frozen_servers() == 1
    c = InferenceServer(ps, ServerConfig(port=0)).start()
    assert heap.frozen_servers() == 2
    a.stop()
    gc.collect()
    assert heap.frozen_servers() == 1 and gc.get_freeze_count() > 0
    assert at_start() is not None, "thawed while a server that froze the heap still runs"
    c.stop()
    assert heap.frozen_servers() == 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert at_start() is None, "the last stop left the start's garbage frozen"
    b.stop()
    try:
        heap.thaw()
    except RuntimeError as e:
        assert "no server holds the heap frozen" in str(e), e
    else:
        raise AssertionError("thaw() without a freeze() passed")
    # a server left running when the process exits: the heap is thawed before the interpreter
    # finalizes (frozen, the exit crashed with SIGSEGV)
    d = InferenceServer(ps, ServerConfig(port=0)).start()
    assert heap.frozen_servers() == 1
    print("lifecycle ok")
    """
)


def test_servers_freeze_the_start_up_heap_until_the_last_one_stops(config: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", _LIFECYCLE, str(config)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "lifecycle ok" in r.stdout, r.stderr[-3000:]


def test_the_cli_flag_and_a_bad_value_of_the_knob() -> None:
    knobs = from_namespace(ServerKnobs, build_parser().parse_args(["--config", "x"]))
    assert knobs.server_config().gc_freeze is True
    off = ["--config", "x", "--no-gc-freeze"]
    assert (
        from_namespace(ServerKnobs, build_parser().parse_args(off)).server_config().gc_freeze
        is False
    )
    with pytest.raises(ValueError, match=r"ServerConfig.gc_freeze must be True or False, got 'no'"):
        ServerConfig(gc_freeze="no")  # type: ignore[arg-type]
