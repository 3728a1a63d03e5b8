"""The committed gRPC message modules: regenerating them from the ``.proto`` files gives the
same bytes; they load in one process beside tritonclient's stubs (which register the same
message names); every field they declare has Triton's number and type, so each side reads the
other's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_pb

import hps.serving.protos.grpc_predict_v2_pb2 as pb
import hps.serving.protos.triton_extensions_pb2 as ext
from hps.serving.protos.regenerate import PROTO_DIR, generate


def test_regenerating_gives_the_committed_files(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        p.name for p in PROTO_DIR.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi"))
    )
    for p in written:
        committed = (PROTO_DIR / p.name).read_text()
        assert p.read_text() == committed, (
            f"{p.name} differs from what `python -m hps.serving.protos.regenerate` writes "
            f"now; committed: {committed.splitlines()[1]}"
        )
    assert "_descriptor_pool.DescriptorPool()" in (tmp_path / "grpc_predict_v2_pb2.py").read_text()


def _triton(full_name: str) -> Descriptor:
    for f in (triton_pb.DESCRIPTOR, triton_config.DESCRIPTOR):
        try:
            return f.pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise KeyError(full_name)


def _messages(d: Descriptor) -> list[Descriptor]:
    return [d, *(m for n in d.nested_types for m in _messages(n))]


@pytest.mark.parametrize("module", [pb, ext], ids=["grpc_predict_v2", "triton_extensions"])
def test_every_field_has_tritons_number_and_type(module) -> None:
    checked = 0
    for top in module.DESCRIPTOR.message_types_by_name.values():
        for m in _messages(top):
            theirs = _triton(m.full_name)
            for f in m.fields:
                t = theirs.fields_by_name[f.name]
                assert (f.number, f.type, f.is_repeated) == (t.number, t.type, t.is_repeated), (
                    f.full_name
                )
                checked += 1
    assert checked > 20
    assert [v.name for v in ext.DataType.DESCRIPTOR.values] == [
        v.name for v in triton_config.DataType.DESCRIPTOR.values
    ]


def test_our_messages_and_tritons_read_each_others_bytes() -> None:
    ours = ext.ModelConfigResponse(
        config=ext.ModelConfig(
            name="m",
            max_batch_size=8,
            input=[ext.ModelInput(name="x", data_type=ext.TYPE_INT64, dims=[3])],
        )
    )
    theirs = triton_pb.ModelConfigResponse.FromString(ours.SerializeToString())
    assert (theirs.config.name, theirs.config.max_batch_size) == ("m", 8)
    assert theirs.config.input[0].data_type == triton_config.TYPE_INT64
    req = triton_pb.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"ab"])
    req.inputs.add(name="x", datatype="INT64", shape=[2, 1])
    req.parameters["priority"].uint64_param = 3  # a Triton field KServe's proto lacks: skipped
    got = pb.ModelInferRequest.FromString(req.SerializeToString())
    assert (got.model_name, got.id, list(got.inputs[0].shape)) == ("m", "7", [2, 1])
    assert list(got.raw_input_contents) == [b"ab"] and got.inputs[0].datatype == "INT64"
