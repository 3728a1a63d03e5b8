"""Request bodies of the v2 HTTP application: read within ``max_request_mb`` (declared or
streamed), then parsed and decompressed within the same limit (JSON parts within
``max_json_mb``) — on the event loop when there is little to parse, else on a worker thread."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request

from hps.serving.servable import CheckedInputs, DLRMServable
from hps.serving.v2_plans import parse_with_plans
from hps.serving.v2_protocol import InferRequest, ProtocolError

__all__ = ["RequestBodies"]

# What is parsed on the event loop: an uncompressed body whose JSON part is at most
# _INLINE_JSON_BYTES (JSON tensors parse at ~50 MB/s: a larger part would stall other
# requests) and whose binary tensors are at most _INLINE_BINARY_BYTES. Binary tensors are not
# parsed, only viewed (np.frombuffer), and checked at memory speed (ids' minimum, dense
# isfinite: ~0.1 ms per MiB here), so a binary request of a few hundred samples takes ~50 µs
# whatever its size, less than the hand-off to a worker thread and back costs.
_INLINE_JSON_BYTES = 64 << 10
_INLINE_BINARY_BYTES = 4 << 20


class RequestBodies:
    """Reads and parses the request bodies of one application.

    Args:
        max_bytes: the largest body, also once decompressed (``max_request_mb``).
        max_json_bytes: the largest JSON part (``max_json_mb``; binary tensors are not bound by it).
        limiter: the worker threads that parse large bodies (``workers``).
    """

    def __init__(self, max_bytes: int, max_json_bytes: int, limiter: anyio.CapacityLimiter) -> None:
        self.max_bytes, self.max_json_bytes, self.limiter = max_bytes, max_json_bytes, limiter

    async def read(self, request: Request) -> bytes | bytearray:
        """The body of ``request`` (:meth:`read_from`)."""
        return await self.read_from(request.headers.get("content-length"), request.receive)

    async def read_from(
        self, declared: str | None, receive: Callable[[], Awaitable[MutableMapping[str, Any]]]
    ) -> bytes | bytearray:
        """The request body from the ASGI ``receive``, refused (``ProtocolError``) past
        ``max_request_mb``; with a ``Content-Length`` (``declared``), read into one buffer of
        that size (no list of chunks to join). ``ClientDisconnect`` when the client leaves
        before the whole body is in."""
        limit = self.max_bytes
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise ProtocolError(
                    f"request body of {declared} bytes exceeds the server's limit of "
                    f"{limit} bytes (--max-request-mb)"
                )
            buf, size = bytearray(int(declared)), 0
            more = True
            while more:
                chunk, more = await _next_chunk(receive)
                if size + len(chunk) > len(buf):
                    raise ProtocolError(
                        f"request body is longer than its Content-Length {declared}"
                    )
                buf[size : size + len(chunk)] = chunk
                size += len(chunk)
            if size != len(buf):
                raise ClientDisconnect()  # uvicorn ends a short body only when the peer left
            return buf
        chunks, size, more = [], 0, True
        while more:
            chunk, more = await _next_chunk(receive)
            size += len(chunk)
            if size > limit:
                raise ProtocolError(
                    f"request body exceeds the server's limit of {limit} bytes (--max-request-mb)"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(
        self,
        s: DLRMServable,
        body: bytes | bytearray,
        header_length: str | None,
        encoding: str | None,
    ) -> tuple[InferRequest, CheckedInputs]:
        """The request parsed and checked: ``(InferRequest, checked inputs)``; on the event
        loop when small, else on a worker thread. ``header_length``, ``encoding``: its
        ``Inference-Header-Content-Length`` and ``Content-Encoding`` headers."""
        if encoding is None and _parse_inline(len(body), header_length):
            return self.parse_checked(s, body, header_length, encoding)
        return await anyio.to_thread.run_sync(
            self.parse_checked, s, body, header_length, encoding, limiter=self.limiter
        )

    def parse_checked(
        self,
        s: DLRMServable,
        body: bytes | bytearray,
        header_length: str | None,
        encoding: str | None,
    ) -> tuple[InferRequest, CheckedInputs]:
        """Parse ``body`` (decompressing ``encoding``, within the limits; by its header's plan
        when one is kept: :mod:`hps.serving.v2_plans`) and check its inputs against ``s``:
        ``(InferRequest, checked inputs)``."""
        req = parse_with_plans(body, header_length, encoding, self.max_bytes, self.max_json_bytes)
        return req, s.check(req.inputs)


async def _next_chunk(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
) -> tuple[bytes, bool]:
    """The next piece of a request body from ``receive``: ``(bytes, more to come)``;
    ``ClientDisconnect`` when the client has gone."""
    while True:
        message = await receive()
        if message["type"] == "http.request":
            return message.get("body", b""), message.get("more_body", False)
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()


def _parse_inline(size: int, header_length: str | None) -> bool:
    """Whether an uncompressed body of ``size`` bytes with that ``Inference-Header-Content-
    Length`` (``None``: all JSON) is cheap enough to parse on the event loop. A malformed
    header length is parsed inline too: it is refused before anything is read."""
    if header_length is None:
        return size <= _INLINE_JSON_BYTES
    try:
        n_json = int(header_length)
    except ValueError:
        return True
    return n_json <= _INLINE_JSON_BYTES and size - n_json <= _INLINE_BINARY_BYTES
