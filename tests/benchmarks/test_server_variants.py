"""``bench_server --servers``: each item's parser, loop, batching, gRPC fronts and onnxruntime
single-thread bound, the unset ones left to the command's flags, and a malformed item named."""

from __future__ import annotations

import re

import pytest

from benchmarks.hps.server_variants import ServerVariant, parse_servers
from hps.serving.connections import EventLoop, HttpParser
from hps.serving.http_server import ServerConfig


def test_each_item_sets_what_it_names_and_leaves_the_rest_to_the_flags() -> None:
    got = parse_servers("auto/auto^0, h11/asyncio@5000:256#2^8000000,httptools/uvloop#0")
    fronts = ServerConfig.grpc_processes
    assert got == [
        ServerVariant(HttpParser.AUTO, EventLoop.AUTO, None, None, fronts, 0),
        ServerVariant(HttpParser.H11, EventLoop.ASYNCIO, 5000, 256, 2, 8_000_000),
        ServerVariant(HttpParser.HTTPTOOLS, EventLoop.UVLOOP, None, None, 0, None),
    ]


@pytest.mark.parametrize("item", ["auto/auto^x", "auto/auto^1.5", "bogus/auto", "auto/auto@1:x"])
def test_a_malformed_item_is_named(item: str) -> None:
    with pytest.raises(ValueError, match=f"--servers: {re.escape(repr(item))} is not "):
        parse_servers(item)
