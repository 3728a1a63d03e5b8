"""Random ``ModelInfer`` calls against the gRPC server: raw random bytes, byte-level mutations
of valid raw and typed requests, and valid requests with a field set to a random value. Every
answer is OK (a mutation can still be a valid request), ``INVALID_ARGUMENT`` or, for a mutated
model name, ``NOT_FOUND``, with a message:
never ``INTERNAL`` or ``UNKNOWN``; afterwards the server scores a valid request correctly."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as triton_pb

from embark.models.dlrm import DLRM
from hps.serving.http_server import InferenceServer
from tests.faults.test_v2_fuzz import _mutate
from tests.hps.serving.tiny_dlrm import eager_logits, make_request
from tests.tolerances import tol

INFER = "/inference.GRPCInferenceService/ModelInfer"
DATATYPES = ["FP32", "INT64", "INT32", "INT8", "UINT64", "BOOL", "FP16", "FP64", "BYTES", "fp32"]


@pytest.fixture(scope="module")
def model(tiny: DLRM) -> DLRM:
    return tiny


@pytest.fixture(scope="module")
def served(both_served: InferenceServer) -> InferenceServer:
    return both_served


def _valid(model: DLRM, raw: bool) -> triton_pb.ModelInferRequest:
    req = make_request(model, 2, seed=3)
    msg = triton_pb.ModelInferRequest(model_name="tiny")
    for name, arr in req.items():
        t = msg.inputs.add(name=name, shape=list(arr.shape))
        t.datatype = "FP32" if arr.dtype == np.float32 else "INT64"
        if raw:
            msg.raw_input_contents.append(arr.tobytes())
        elif arr.dtype == np.float32:
            t.contents.fp32_contents.extend(arr.reshape(-1).tolist())
        else:
            t.contents.int64_contents.extend(arr.reshape(-1).tolist())
    return msg


_edits = st.lists(
    st.tuples(
        st.floats(0, 1),
        st.sampled_from(["replace", "insert", "cut"]),
        st.binary(min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=4,
)


@st.composite
def _field_edit(draw: st.DrawFn, msg: triton_pb.ModelInferRequest) -> bytes:
    """``msg`` with one input's name, datatype, shape or raw contents set to a random value."""
    out = triton_pb.ModelInferRequest()
    out.CopyFrom(msg)
    i = draw(st.integers(0, len(out.inputs) - 1))
    t = out.inputs[i]
    what = draw(st.sampled_from(["name", "datatype", "shape", "raw", "model", "outputs"]))
    if what == "name":
        t.name = draw(st.sampled_from(["", "dense", "ids_t0", "logits", "x" * 300]))
    elif what == "datatype":
        t.datatype = draw(st.sampled_from(DATATYPES))
    elif what == "shape":
        t.ClearField("shape")
        t.shape.extend(draw(st.lists(st.integers(-2, 2**62), max_size=4)))
    elif what == "raw" and out.raw_input_contents:
        out.raw_input_contents[i] = draw(st.binary(max_size=64))
    elif what == "model":
        out.model_version = draw(st.sampled_from(["", "1", "2", "x"]))
    else:
        out.outputs.add(name=draw(st.sampled_from(["logits", "probability", "x", ""])))
    return out.SerializeToString()


def test_random_infer_calls_are_ok_or_invalid_argument(
    served: InferenceServer, model: DLRM
) -> None:
    assert served.grpc_address is not None
    valid = [_valid(model, raw=True), _valid(model, raw=False)]
    channel = grpc.insecure_channel(served.grpc_address)
    call = channel.unary_unary(INFER)  # bytes in, bytes out: any payload reaches the server

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def answered_clearly(data: st.DataObject) -> None:
        base = data.draw(st.sampled_from(valid))
        kind = data.draw(st.sampled_from(["random", "mutated", "field"]))
        if kind == "random":
            body = data.draw(st.binary(max_size=2048))
        elif kind == "mutated":
            body = _mutate(base.SerializeToString(), data.draw(_edits))
        else:
            body = data.draw(_field_edit(base))
        try:
            call(body, timeout=60)
        except grpc.RpcError as e:
            # NOT_FOUND: a mutation of the model's name
            bad = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert e.code() in bad, (kind, e.code(), e.details())
            assert e.details(), kind

    with channel:
        answered_clearly()
        resp = triton_pb.ModelInferResponse.FromString(call(valid[0].SerializeToString()))
    got = np.frombuffer(resp.raw_output_contents[0], np.float32)
    want = eager_logits(model, make_request(model, 2, seed=3))
    np.testing.assert_allclose(got, want, **tol("served"))
