"""The KServe v2 gRPC inference messages: a ``ModelInferRequest`` read into the same
:class:`~hps.serving.v2_protocol.InferRequest` the HTTP protocol parses, and results written
into a ``ModelInferResponse`` (messages of ``grpc_predict_v2.proto``, :mod:`hps.serving.protos`).

An input carries its values in one of two ways, the same for every input of a request::

    raw:    inputs[i] = {name: "dense", datatype: "FP32", shape: [2, 3]}
            raw_input_contents[i] = 24 bytes: 6 × float32 little-endian, row-major
    typed:  inputs[i] = {name: "dense", datatype: "FP32", shape: [2, 3],
                         contents: {fp32_contents: [0.5, 1, 2, 3, 4, 5]}}

``raw_input_contents`` holds one entry per input, in input order, or none. The typed field
of each datatype is :data:`CONTENTS_FIELD` (FP16 has none: it is sent raw). Outputs are always
returned raw (``raw_output_contents[i]`` for ``outputs[i]``), which is what
``tritonclient.grpc``'s ``as_numpy`` reads. Errors raise
:class:`~hps.serving.v2_protocol.ProtocolError` with the wording of the HTTP protocol's, so a
client sees the same message (status ``INVALID_ARGUMENT``) on both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

import hps.serving.protos.grpc_predict_v2_pb2 as pb
from hps.serving.clipping import clip
from hps.serving.v2_protocol import (
    DTYPES,
    InferRequest,
    ProtocolError,
    RequestedOutput,
    check_datatype,
    check_shape,
    select_outputs,
)

__all__ = ["CONTENTS_FIELD", "encode_grpc_response", "parse_grpc_request"]

# v2 datatype → the InferTensorContents field that carries its values (FP16: raw only).
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
_NAMES = {v: k for k, v in DTYPES.items()}


def _parameter(p: pb.InferParameter) -> bool | int | str | None:
    choice = p.WhichOneof("parameter_choice")
    return None if choice is None else getattr(p, choice)


def parse_grpc_request(msg: pb.ModelInferRequest) -> InferRequest:
    """Read a ``ModelInferRequest``'s tensors.

    Args:
        msg: the request (its ``raw_input_contents`` are shared, not copied).

    Returns:
        the request; ``inputs[name]`` has the shape sent and the dtype of its datatype
        (read-only views of raw contents); every requested output is returned raw.

    Raises:
        ProtocolError: no inputs, an input without a name or given twice, an unknown
            datatype, a negative dimension, raw contents whose count or sizes do not match the
            inputs, raw and typed contents mixed, typed contents in another datatype's field,
            a value count that does not match the shape, an integer outside its datatype.
    """
    tensors = msg.inputs
    if not tensors:
        raise ProtocolError("request needs a non-empty 'inputs' list")
    raw = list(msg.raw_input_contents)  # one conversion; the bytes themselves are shared
    if raw and len(raw) != len(tensors):
        raise ProtocolError(
            f"raw_input_contents has {len(raw)} entries for {len(tensors)} inputs; "
            "give one per input, in input order, or none"
        )
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    # The hot path reads each field once and builds no message text; the checks' own
    # functions run (and word the error) only for a value they would refuse.
    for i, t in enumerate(tensors):
        name, dt_name = t.name, t.datatype
        if not name:
            raise ProtocolError(f"inputs[{i}].name must be a non-empty string")
        if name in inputs:
            raise ProtocolError(f"{_where(name)} is given twice")
        found = DTYPES.get(dt_name)
        dtype = check_datatype(dt_name, _where(name)) if found is None else found
        shape = tuple(t.shape[:])  # a slice: one call, not an iteration of the container
        if shape and min(shape) < 0:
            check_shape(list(shape), _where(name))
        if raw:
            if t.HasField("contents"):
                raise ProtocolError(f"{_where(name)} has both 'contents' and raw_input_contents")
            arr = _from_raw(raw[i], dt_name, dtype, shape, name)
        else:
            arr = _from_contents(t.contents, dt_name, dtype, shape, _where(name))
        inputs[name] = arr
        datatypes[name] = dt_name
    outputs = [RequestedOutput(o.name, binary=True) for o in msg.outputs] if msg.outputs else None
    parameters = {k: _parameter(v) for k, v in msg.parameters.items()} if msg.parameters else {}
    return InferRequest(
        inputs,
        datatypes,
        outputs,
        binary_output=True,
        id=msg.id or None,
        parameters=parameters,
    )


def _where(name: str) -> str:
    return f"input {clip(name)!r}"


def _from_raw(
    raw: bytes, dt_name: str, dtype: np.dtype, shape: tuple[int, ...], name: str
) -> np.ndarray:
    """A read-only ``shape`` array of ``dtype`` over ``raw`` (no copy)."""
    need = math.prod(shape) * dtype.itemsize  # Python ints: no wrap-around for huge shapes
    if len(raw) != need:
        raise ProtocolError(
            f"{_where(name)}: raw_input_contents holds {len(raw)} bytes but shape "
            f"{list(shape)} × {dt_name} needs {need} bytes"
        )
    return np.ndarray(shape, dtype, raw)


def _from_contents(
    contents: pb.InferTensorContents,
    dt_name: str,
    dtype: np.dtype,
    shape: tuple[int, ...],
    where: str,
) -> np.ndarray:
    field = CONTENTS_FIELD.get(dt_name)
    if field is None:
        raise ProtocolError(f"{where}: datatype {dt_name} has no typed contents; send it raw")
    for f, _ in contents.ListFields():
        if f.name != field:
            raise ProtocolError(
                f"{where}: datatype {dt_name} carries its values in contents.{field}, "
                f"got contents.{f.name}"
            )
    values = getattr(contents, field)
    n = math.prod(shape)
    if len(values) != n:
        raise ProtocolError(
            f"{where}: shape {list(shape)} needs {n} values, contents.{field} has {len(values)}"
        )
    wide = np.asarray(values, dtype=DTYPES[_WIDE[field]])
    if dtype.kind in "iu" and wide.size and dtype != wide.dtype:
        info = np.iinfo(dtype)
        lo, hi = int(wide.min()), int(wide.max())
        if lo < info.min or hi > info.max:
            raise ProtocolError(
                f"{where}: contents.{field} value {lo if lo < info.min else hi} is out of "
                f"range for {dt_name} [{info.min}, {info.max}]"
            )
    return wide.astype(dtype).reshape(shape)


# Each contents field's own element type: values are read at it, then narrowed.
_WIDE = {
    "bool_contents": "BOOL",
    "int_contents": "INT32",
    "int64_contents": "INT64",
    "uint_contents": "UINT32",
    "uint64_contents": "UINT64",
    "fp32_contents": "FP32",
    "fp64_contents": "FP64",
}


def encode_grpc_response(
    model_name: str,
    model_version: str,
    results: Mapping[str, np.ndarray],
    request: InferRequest,
) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of ``results`` (every output the model computed, by name;
    a dtype of ``DTYPES``): the outputs ``request`` asks for (all when it names none), raw.

    Raises:
        ProtocolError: the request asks for an output the model does not have.
    """
    resp = pb.ModelInferResponse(model_name=model_name, model_version=model_version)
    if request.id is not None:
        resp.id = request.id
    for o in select_outputs(results, request):
        arr = np.ascontiguousarray(results[o.name])
        dt = _NAMES[arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype]
        resp.outputs.add(name=o.name, datatype=dt, shape=list(arr.shape))
        resp.raw_output_contents.append(arr.astype(DTYPES[dt], copy=False).tobytes())
    return resp
