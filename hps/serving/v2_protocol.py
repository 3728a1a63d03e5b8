"""The KServe v2 (Triton) HTTP inference protocol: request parsing and response encoding, with
the binary tensor extension that ``tritonclient.http`` uses by default.

A request body is JSON, optionally followed by raw tensor bytes. The header
``Inference-Header-Content-Length: L`` says the first ``L`` bytes are the JSON; each input whose
``parameters.binary_data_size`` is set takes that many bytes of the rest, in input order::

    body = | {"inputs": [{"name": "dense",     "shape": [2, 3], "datatype": "FP32",
           |              "parameters": {"binary_data_size": 24}},
           |             {"name": "ids_t0",    "shape": [2, 1], "datatype": "INT64",
           |              "data": [7, 3]}],                              (JSON data: row-major)
           |  "outputs": [{"name": "probability", "parameters": {"binary_data": true}}]}
           | 24 bytes: dense, 6 × float32 little-endian
           ↑ L bytes of JSON ↑

The response mirrors it: outputs asked for with ``binary_data: true`` (or all of them when the
request's ``parameters.binary_data_output`` is true, which tritonclient sets when it names no
outputs) are appended as raw bytes with their ``binary_data_size``; the others carry ``data``
as a flat row-major list. Errors are ``{"error": "..."}`` (the server sends status 400).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import numpy as np

from hps.serving.clipping import clip

__all__ = [
    "DTYPES",
    "HEADER_LENGTH",
    "MODEL_VERSION",
    "SERVER_NAME",
    "InferRequest",
    "ProtocolError",
    "RequestedOutput",
    "check_datatype",
    "check_shape",
    "encode_infer_response",
    "find_model",
    "parse_infer_request",
    "repository_index",
    "repository_index_request",
    "select_outputs",
    "server_version",
]

HEADER_LENGTH = "Inference-Header-Content-Length"
SERVER_NAME = "tilerec-hps"
MODEL_VERSION = "1"  # each model has one version; a request naming none gets it
_Model = TypeVar("_Model")

# v2 datatype name → numpy dtype (little-endian, as the binary extension specifies).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class ProtocolError(ValueError):
    """A request that does not follow the protocol (or asks for something the model lacks);
    the message names the bad field or value."""


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool


@dataclass
class InferRequest:
    """A parsed ``/infer`` request.

    ``inputs`` maps each input name to its array (shape as sent, dtype of its ``datatype``);
    ``outputs`` is ``None`` when the request names none (then every output is returned).
    """

    inputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    outputs: list[RequestedOutput] | None
    binary_output: bool
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


#: Bytes inflated per step while a compressed body is measured (:func:`_decompress`).
_INFLATE_CHUNK = 1 << 20


def _decompress(
    body: bytes | bytearray, content_encoding: str | None, max_bytes: int | None
) -> bytes | bytearray:
    """The body decoded; at most ``max_bytes`` once decompressed (a small gzip body can expand
    to gigabytes). The decoded size is measured first by inflating in 1 MiB steps that are
    dropped at once, so a body past the limit is refused having held 1 MiB of its output, never
    the limit's worth; a body within it is then decoded into one buffer of its exact size."""
    enc = (content_encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc not in ("gzip", "deflate"):
        raise ProtocolError(
            f"unsupported Content-Encoding {clip(str(content_encoding))!r}; expected gzip, "
            "deflate or none"
        )
    wbits = 31 if enc == "gzip" else 15
    d = zlib.decompressobj(wbits=wbits)
    size, data = 0, body
    try:
        while True:
            chunk = d.decompress(data, _INFLATE_CHUNK)
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise ProtocolError(
                    f"request body decompresses to more than the server's limit of "
                    f"{max_bytes} bytes"
                )
            data = d.unconsumed_tail
            if d.eof or not (data or chunk):
                break
        if not d.eof:
            raise ProtocolError(f"request body is not valid {enc} data: truncated stream")
        return zlib.decompress(body, wbits, max(size, 1))
    except zlib.error as e:
        raise ProtocolError(f"request body is not valid {enc} data: {e}") from None


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"{where} must be true or false, got {clip(repr(v))}")
    return v


def server_version() -> str:
    """The version the server reports in its metadata (the installed tilerec's)."""
    try:
        return version("tilerec")
    except PackageNotFoundError:
        return "0"


def find_model(models: Mapping[str, _Model], name: str, model_version: str | None) -> _Model:
    """The model a request names, HTTP (path) and gRPC (fields) alike.

    Args:
        models: model name → model.
        name: the requested model.
        model_version: the requested version; ``None`` or ``""``: :data:`MODEL_VERSION`.

    Raises:
        ProtocolError: an unknown model, or a version other than :data:`MODEL_VERSION`.
    """
    if name not in models:
        raise ProtocolError(f"unknown model {clip(name)!r}; this server serves {sorted(models)}")
    if model_version not in (None, "", MODEL_VERSION):
        raise ProtocolError(
            f"model {clip(name)!r} has no version {clip(str(model_version))!r}; "
            f"versions: ['{MODEL_VERSION}']"
        )
    return models[name]


def repository_index(models: Mapping[str, object]) -> list[dict[str, str]]:
    """Triton's repository index of ``models``: each ``{"name", "version", "state": "READY"}``
    (a server serves only models that have loaded)."""
    return [{"name": n, "version": MODEL_VERSION, "state": "READY"} for n in models]


def repository_index_request(body: bytes | bytearray) -> bool:
    """The ``ready`` flag of a ``POST /v2/repository/index`` body (empty: false).

    Raises:
        ProtocolError: a body that is not a JSON object, or a ``ready`` that is not a boolean.
    """
    if not body.strip():
        return False
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(f"repository index request JSON is malformed: {e}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(
            f"repository index request must be a JSON object, got {type(doc).__name__}"
        )
    return _bool(doc.get("ready", False), "repository index request 'ready'")


def check_datatype(v: Any, where: str) -> np.dtype:
    """The numpy dtype of v2 datatype name ``v`` (``ProtocolError`` naming ``where`` if none)."""
    if not isinstance(v, str) or v not in DTYPES:  # a JSON list or object: unhashable
        raise ProtocolError(f"{where}: datatype {clip(repr(v))} is not one of {sorted(DTYPES)}")
    return DTYPES[v]


def check_shape(v: Any, where: str) -> tuple[int, ...]:
    """``v`` as a shape: a list of non-negative integers (``ProtocolError`` naming ``where``)."""
    if not isinstance(v, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in v
    ):
        raise ProtocolError(f"{where}.shape must be a list of integers, got {clip(repr(v))}")
    if any(d < 0 for d in v):
        raise ProtocolError(f"{where}.shape must not be negative, got {v}")
    return tuple(v)


def _as_array(data: Any, where: str, dtype: Any = None) -> np.ndarray:
    try:
        return np.asarray(data, dtype=dtype)
    except ValueError as e:  # ragged nesting
        raise ProtocolError(f"{where}.data is not a regular array: {e}") from None
    except RecursionError:
        raise ProtocolError(f"{where}.data is nested too deeply") from None


def _check_integers(data: Any, dtype: np.dtype, where: str) -> None:
    """Name the value that makes integer ``data`` parse as float or object: a non-integer, or
    an integer outside ``dtype``'s range (JSON integers are unbounded)."""
    info = np.iinfo(dtype)
    for x in _as_array(data, where, dtype=object).reshape(-1):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ProtocolError(
                f"{where}.data holds non-integer values for an integer datatype (e.g. {clip(repr(x))})"
            )
        if not info.min <= x <= info.max:
            raise ProtocolError(
                f"{where}.data value {x} is out of range for {_NAMES[dtype]} "
                f"[{info.min}, {info.max}]"
            )


def _holds_bool(data: Any) -> bool:
    """Whether JSON ``data`` (a regular nest of lists) holds a ``true``/``false`` anywhere:
    numpy turns ``[1, true]`` into ``[1, 1]`` without a word."""
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            if x and not isinstance(x[0], list):  # innermost list: scalars only (regular)
                if bool in map(type, x):
                    return True
            else:
                stack.extend(x)
        elif type(x) is bool:
            return True
    return False


def _json_data(data: Any, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    arr = _as_array(data, where)
    if dtype.kind in "iu" and arr.size and (arr.dtype == object or arr.dtype.kind == "f"):
        _check_integers(data, dtype, where)  # always raises: a float, or an int past int64/uint64
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise ProtocolError(f"{where}.data must hold numbers, got {arr.dtype} values")
    if dtype.kind != "b" and arr.size and (arr.dtype.kind == "b" or _holds_bool(data)):
        raise ProtocolError(
            f"{where}.data holds true/false for datatype {_NAMES[dtype]} "
            "(booleans are values of a BOOL input only)"
        )
    n = math.prod(shape)  # Python ints: no int64 wrap-around for huge declared shapes
    if arr.size != n:
        raise ProtocolError(f"{where}: shape {list(shape)} needs {n} values, data has {arr.size}")
    if dtype.kind in "iu" and arr.size:
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:  # e.g. 2**63 parses as uint64
            raise ProtocolError(
                f"{where}.data value {lo if lo < info.min else hi} is out of "
                f"range for {_NAMES[dtype]} [{info.min}, {info.max}]"
            )
    return arr.astype(dtype, copy=False).reshape(shape)


def parse_infer_request(
    body: bytes | bytearray,
    header_length: str | int | None = None,
    content_encoding: str | None = None,
    max_bytes: int | None = None,
    max_json_bytes: int | None = None,
) -> InferRequest:
    """Parse an ``/infer`` body.

    Args:
        body: the raw HTTP body (compressed when ``content_encoding`` says so).
        header_length: the ``Inference-Header-Content-Length`` header, or ``None`` when the
            body is JSON only.
        content_encoding: the ``Content-Encoding`` header (``gzip``, ``deflate`` or none).
        max_bytes: the largest decompressed body accepted (``None``: no limit).
        max_json_bytes: the largest JSON part accepted (``None``: no limit), checked before
            it is parsed: parsed JSON numbers take ~10× their text's memory, so large tensors
            belong in the binary extension.

    Returns:
        the request; binary inputs are views of ``body``'s bytes (read-only when it is ``bytes``).

    Raises:
        ProtocolError: malformed or too deeply nested JSON, a missing or mistyped field (a
            ``binary_data`` that is not a JSON boolean), an unknown datatype, data whose count
            does not match its shape or whose integers exceed the datatype's range, binary
            sizes that do not add up.
    """
    body = _decompress(body, content_encoding, max_bytes)
    doc, binary = _split_body(body, header_length, max_json_bytes)
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("request needs a non-empty 'inputs' list")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError("request 'parameters' must be an object")
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    pos = 0
    for i, spec in enumerate(raw_inputs):
        name, dt_name, arr, pos = _parse_input(i, spec, binary, pos, inputs)
        inputs[name] = arr
        datatypes[name] = dt_name
    if pos != len(binary):
        raise ProtocolError(f"{len(binary) - pos} bytes after the JSON header belong to no input")
    binary_output = _bool(params.get("binary_data_output", False), "parameters.binary_data_output")
    rid = doc.get("id")
    return InferRequest(
        inputs,
        datatypes,
        _parse_outputs(doc, binary_output),
        binary_output,
        id=str(rid) if rid is not None else None,
        parameters=params,
    )


def _split_body(
    body: bytes | bytearray, header_length: str | int | None, max_json_bytes: int | None = None
) -> tuple[dict[str, Any], memoryview]:
    """``(the JSON header as an object, the binary bytes after it)``."""
    if header_length is None:
        n_json = len(body)
    else:
        try:
            n_json = int(header_length)
        except (TypeError, ValueError):
            raise ProtocolError(
                f"{HEADER_LENGTH} must be an integer, got {clip(str(header_length))!r}"
            ) from None
        if not 0 < n_json <= len(body):
            raise ProtocolError(
                f"{HEADER_LENGTH} {n_json} is outside the body of {len(body)} bytes"
            )
    if max_json_bytes is not None and n_json > max_json_bytes:
        raise ProtocolError(
            f"request JSON of {n_json} bytes exceeds the server's limit of {max_json_bytes} "
            f"bytes (--max-json-mb); send large tensors as binary data "
            f"({HEADER_LENGTH}, binary_data_size)"
        )
    try:
        doc = json.loads(body[:n_json] if n_json < len(body) else body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"request JSON is malformed: {e}") from None
    except RecursionError:
        raise ProtocolError("request JSON is nested too deeply") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"request must be a JSON object, got {type(doc).__name__}")
    return doc, memoryview(body)[n_json:]


def _parse_input(
    i: int, spec: Any, binary: memoryview, pos: int, seen: dict[str, np.ndarray]
) -> tuple[str, str, np.ndarray, int]:
    """Input ``i`` of the request: ``(name, datatype, array, binary position after it)``;
    ``seen`` holds the inputs before it."""
    if not isinstance(spec, dict):
        raise ProtocolError(f"inputs[{i}] must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"inputs[{i}].name must be a non-empty string")
    if name in seen:
        raise ProtocolError(f"{_where(name)} is given twice")
    # the hot path reads each field once and builds no message text: the checks' own
    # functions run (and word the error) only for a value they would refuse
    dt_given = spec.get("datatype")
    dtype = DTYPES.get(dt_given) if type(dt_given) is str else None
    if dtype is None:
        dtype = check_datatype(dt_given, _where(name))  # raises
    dt_name = _NAMES[dtype]
    shape_v = spec.get("shape")
    if type(shape_v) is list and all(type(d) is int for d in shape_v):
        shape = tuple(shape_v)
        if shape and min(shape) < 0:
            check_shape(shape_v, _where(name))  # raises
    else:
        shape = check_shape(shape_v, _where(name))
    p = spec.get("parameters") or {}
    if not isinstance(p, dict):
        raise ProtocolError(f"{_where(name)}.parameters must be an object")
    size = p.get("binary_data_size")
    if size is None:
        where = _where(name)
        if "data" not in spec:
            raise ProtocolError(f"{where} has neither 'data' nor parameters.binary_data_size")
        return name, dt_name, _json_data(spec["data"], dtype, shape, where), pos
    if "data" in spec:
        raise ProtocolError(f"{_where(name)} has both 'data' and binary_data_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError(
            f"{_where(name)}.binary_data_size must be a non-negative integer, "
            f"got {clip(repr(size))}"
        )
    need = math.prod(shape) * dtype.itemsize
    if size != need:
        raise ProtocolError(
            f"{_where(name)}: binary_data_size {size} but shape {list(shape)} × "
            f"{dt_name} needs {need} bytes"
        )
    if pos + size > len(binary):
        raise ProtocolError(
            f"{_where(name)}: binary data ends at byte {pos + size} but the body "
            f"carries {len(binary)} bytes after the JSON header"
        )
    arr = np.frombuffer(binary[pos : pos + size], dtype=dtype).reshape(shape)
    return name, dt_name, arr, pos + size


def _where(name: str) -> str:
    return f"input {clip(name)!r}"


def _parse_outputs(doc: dict[str, Any], binary_output: bool) -> list[RequestedOutput] | None:
    """The outputs a request names (``None`` when it names none: every output is returned)."""
    if "outputs" not in doc:
        return None
    raw_out = doc["outputs"]
    if not isinstance(raw_out, list):
        raise ProtocolError("request 'outputs' must be a list")
    outputs = []
    for i, o in enumerate(raw_out):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise ProtocolError(f"outputs[{i}] must be an object with a 'name'")
        op = o.get("parameters") or {}
        if not isinstance(op, dict):
            raise ProtocolError(f"outputs[{i}].parameters must be an object")
        as_binary = _bool(
            op.get("binary_data", binary_output), f"outputs[{i}].parameters.binary_data"
        )
        outputs.append(RequestedOutput(o["name"], as_binary))
    return outputs


def select_outputs(
    results: Mapping[str, np.ndarray], request: InferRequest
) -> list[RequestedOutput]:
    """The outputs to return, in order: those the request names, or all of ``results``.

    Raises:
        ProtocolError: the request names an output the model does not have.
    """
    if request.outputs is None:
        return [RequestedOutput(n, request.binary_output) for n in results]
    for o in request.outputs:
        if o.name not in results:
            raise ProtocolError(f"unknown output {clip(o.name)!r}; the model has {sorted(results)}")
    return request.outputs


def encode_infer_response(
    model_name: str, model_version: str, results: dict[str, np.ndarray], request: InferRequest
) -> tuple[bytes, dict[str, str]]:
    """The ``/infer`` response body and its extra headers.

    Args:
        results: every output the model computed, by name (any shape, a dtype of ``DTYPES``).
        request: the parsed request: which outputs to return, binary or JSON.

    Returns:
        ``(body, headers)``; ``headers`` holds ``Inference-Header-Content-Length`` when any
        output is binary.

    Raises:
        ProtocolError: the request asks for an output the model does not have.
    """
    wanted = select_outputs(results, request)
    outs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for o in wanted:
        arr = np.ascontiguousarray(results[o.name])
        dt = _NAMES[arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype]
        entry: dict[str, Any] = {"name": o.name, "datatype": dt, "shape": list(arr.shape)}
        if o.binary:
            raw = arr.astype(DTYPES[dt], copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        outs.append(entry)
    doc: dict[str, Any] = {
        "model_name": model_name,
        "model_version": model_version,
        "outputs": outs,
    }
    if request.id is not None:
        doc["id"] = request.id
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return b"".join([head, *blobs]), {
        HEADER_LENGTH: str(len(head)),
        "Content-Type": "application/octet-stream",
    }
