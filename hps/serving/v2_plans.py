"""``/infer`` bodies parsed by the plan of their JSON header (:func:`parse_with_plans`).

A client sending binary tensors sends the same JSON header, byte for byte, with every request
of one batch size: tritonclient writes the same names, shapes, datatypes and sizes each time.
Parsing that header (``json.loads``, then each input's fields checked) is most of what a small
request costs to parse: 55 µs for the tiny model's 9 inputs, on this project's 2-core host.
So the first request with a given header is parsed in full
(:func:`~hps.serving.v2_protocol.parse_infer_request`) and, when every input of it is binary,
the result without its tensors is kept as a *plan*, under those exact header bytes. A later
request with the same bytes and a binary part of the same length is then only sliced: each
input a view of its bytes (``np.frombuffer``; read-only when the body is ``bytes``), as the
full parse gives it. Anything else (JSON tensors, a request ``id``, compressed bodies, a binary
part of another length, nested parameters, headers over :data:`MAX_PLAN_HEADER_BYTES`) is
parsed in full every time, so every error is the full parser's; deciding that such a request
has no plan costs no second parse of its header. At most :data:`MAX_PLANS` plans are kept,
the least recently used going first: their memory does not grow with the requests served.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from hps.serving.v2_protocol import InferRequest, RequestedOutput, parse_infer_request

__all__ = ["MAX_PLANS", "MAX_PLAN_HEADER_BYTES", "parse_with_plans", "plans_held"]

#: Plans kept at once (one per distinct header: a client sending many batch sizes has many).
MAX_PLANS = 256
#: The longest JSON header kept as a plan's key (a binary header takes ~100 bytes per input).
MAX_PLAN_HEADER_BYTES = 16 << 10

_Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class _Plan:
    """What every body with one JSON header parses to, but its tensors' bytes."""

    inputs: tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]  # name, dtype, shape, bytes
    datatypes: tuple[tuple[str, str], ...]
    binary_bytes: int  # the length of the binary part every input's bytes fill
    outputs: tuple[RequestedOutput, ...] | None
    binary_output: bool
    parameters: tuple[tuple[str, _Scalar], ...]

    def request(self, binary: memoryview) -> InferRequest:
        """The request whose binary part (of :attr:`binary_bytes`) is ``binary``."""
        inputs: dict[str, np.ndarray] = {}
        pos = 0
        for name, dtype, shape, size in self.inputs:
            inputs[name] = np.frombuffer(binary[pos : pos + size], dtype=dtype).reshape(shape)
            pos += size
        return InferRequest(
            inputs,
            dict(self.datatypes),
            None if self.outputs is None else list(self.outputs),
            self.binary_output,
            id=None,
            parameters=dict(self.parameters),
        )


_plans: OrderedDict[bytes, _Plan] = OrderedDict()
_plans_lock = threading.Lock()


def plans_held() -> int:
    """How many plans are kept now (at most :data:`MAX_PLANS`)."""
    return len(_plans)


def parse_with_plans(
    body: bytes | bytearray,
    header_length: str | int | None,
    content_encoding: str | None,
    max_bytes: int | None,
    max_json_bytes: int | None,
) -> InferRequest:
    """:func:`~hps.serving.v2_protocol.parse_infer_request` (same arguments, result and
    errors), sliced by the plan of its JSON header when one is kept (see the module)."""
    n_json = _plain_header_length(body, header_length, content_encoding, max_json_bytes)
    if n_json is None:
        return parse_infer_request(body, header_length, content_encoding, max_bytes, max_json_bytes)
    head = bytes(body[:n_json])
    plan = _plans.get(head)
    if plan is not None and plan.binary_bytes == len(body) - n_json:
        try:
            _plans.move_to_end(head)  # the most recently used
        except KeyError:  # another thread dropped it meanwhile: it was used all the same
            pass
        return plan.request(memoryview(body)[n_json:])
    req = parse_infer_request(body, header_length, content_encoding, max_bytes, max_json_bytes)
    plan = _plan_of(head, req, len(body) - n_json)
    if plan is not None:
        with _plans_lock:
            if len(_plans) >= MAX_PLANS and head not in _plans:
                _plans.popitem(last=False)  # the least recently used
            _plans[head] = plan
    return req


def _plain_header_length(
    body: bytes | bytearray,
    header_length: str | int | None,
    content_encoding: str | None,
    max_json_bytes: int | None,
) -> int | None:
    """The JSON header's length when a plan may serve this body: uncompressed, with binary
    data, a header length the full parser accepts, at most :data:`MAX_PLAN_HEADER_BYTES`;
    else ``None``."""
    if header_length is None or (content_encoding or "identity").strip().lower() != "identity":
        return None
    try:
        n = int(header_length)
    except (TypeError, ValueError):
        return None
    limit = (
        MAX_PLAN_HEADER_BYTES
        if max_json_bytes is None
        else min(max_json_bytes, MAX_PLAN_HEADER_BYTES)
    )
    return n if 0 < n <= min(len(body), limit) else None


def _plan_of(head: bytes, req: InferRequest, binary_bytes: int) -> _Plan | None:
    """The plan of a request the full parser accepted, whose header is ``head``; ``None``
    unless every input is binary, there is no ``id`` and every parameter is a scalar. The
    checks on the parsed request come first, so a request with an ``id`` or JSON tensors is
    refused without parsing its header again."""
    params = req.parameters
    if req.id is not None or not all(
        v is None or isinstance(v, (str, int, float, bool)) for v in params.values()
    ):
        return None
    inputs = tuple((n, a.dtype, a.shape, a.nbytes) for n, a in req.inputs.items())
    if sum(x[3] for x in inputs) != binary_bytes:  # some input's values were JSON
        return None
    specs = json.loads(head)["inputs"]  # parsed without error a moment ago
    if not all(
        "data" not in s and "binary_data_size" in (s.get("parameters") or {}) for s in specs
    ):
        return None  # an empty JSON tensor beside binary ones
    return _Plan(
        inputs,
        tuple(req.datatypes.items()),
        binary_bytes,
        None if req.outputs is None else tuple(req.outputs),
        req.binary_output,
        tuple(params.items()),
    )
