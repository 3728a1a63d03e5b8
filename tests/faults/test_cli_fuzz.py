"""Random bytes and random documents as recipe files, plan files and checkpoints (issue #22,
the fault suite's property test, its CLI part).

Every outcome is a ``ValueError`` (the documented error type of each reader) whose message
names the file — never another exception, never a hang (each call runs under an alarm).
A random document may also happen to be valid: then it loads (and a checkpoint that loads
also trains a step). The readers are called in process for speed; two subprocess checks show
the command lines exit 2 with one line. ``TILEREC_FUZZ_EXAMPLES`` raises the number of examples
per property (150) for a longer campaign.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from embark.data import Batch
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.planner.manual import load_plan
from embark.sharding.run import ShardedRunConfig, resolve_plan
from embark.topology import get_topology
from embark.training.config import TrainConfig
from embark.training.trainer import Trainer, TrainingDiverged
from tilesparse import TileSparseConfig

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("TILEREC_FUZZ_EXAMPLES", "150"))
HANG_S = 30  # no reader needs a second on these inputs; this only detects a hang
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

W = get_workload("tiny")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch intra-op thread for the tiny model's training steps: on 2 shared cores a second
    thread only contends (the mutated-state property took 3.6× the CPU time with 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Hang(BaseException):  # noqa: N818 - not an error a reader could catch and rename
    """A call ran past :data:`HANG_S`."""


@contextmanager
def _bounded() -> Iterator[None]:
    def alarm(signum: int, frame: object) -> None:
        raise Hang(f"no answer within {HANG_S} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _outcome(call: Callable[[], T], names: str) -> T | None:
    """``call()``'s result, or ``None`` when it raised a ``ValueError`` naming ``names`` (a
    path); any other exception, a message without the name or a hang fails the test."""
    with _bounded():
        try:
            return call()
        except ValueError as err:
            assert names in str(err), f"{type(err).__name__} does not name {names}: {err}"
            return None


# JSON values, nested a little: what a hand-edited or foreign file may hold
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
_SMALL = st.integers(-2, 9) | JSON  # near the valid values: 0, 1, 2 ranks, rows ...


def _keyed(
    keys: list[str], values: st.SearchStrategy[Any] = JSON
) -> st.SearchStrategy[dict[str, Any]]:
    """Mappings over (mostly) the reader's own keys, with random values."""
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=8), values, max_size=len(keys))


# -- recipe files: TileSparseConfig.load, prune_dlrm --recipe ---------------------------------
RECIPE_KEYS = [*TileSparseConfig().to_dict()]
SCHEDULE_KEYS = ["kind", "stages", "steps_per_stage", "start", "step", "begin_step", "end_step",
                 "frequency", "initial_sparsity"]  # fmt: skip


def _recipe_doc() -> st.SearchStrategy[dict[str, Any]]:
    return _keyed(RECIPE_KEYS, JSON | _keyed(SCHEDULE_KEYS))


@FUZZ
@given(data=st.binary(max_size=1500), suffix=st.sampled_from([".yaml", ".json", ".yml"]))
def test_recipe_files_of_random_bytes(data: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"recipe{suffix}"
        path.write_bytes(data)
        _outcome(lambda: TileSparseConfig.load(path), str(path))


@FUZZ
@given(doc=_recipe_doc(), suffix=st.sampled_from([".yaml", ".json"]))
def test_recipe_files_of_random_documents(doc: dict[str, Any], suffix: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"recipe{suffix}"
        path.write_text(json.dumps(doc))  # JSON is YAML too
        _outcome(lambda: TileSparseConfig.load(path), str(path))


# -- plan files: embark.plan --strategy FILE (load_plan), sharded_train --plan ----------------
def _mutated(doc: Any, data: st.DataObject, values: st.SearchStrategy[Any]) -> Any:
    """``doc`` with one node replaced by a drawn value, or one entry of a mapping or list
    dropped: a walk from the root that goes down into a random child (3 times in 4).
    Starting from a valid document, this reaches the checks deep inside a reader."""
    if isinstance(doc, dict | list) and doc and data.draw(st.integers(0, 3)) > 0:
        keys = sorted(doc) if isinstance(doc, dict) else list(range(len(doc)))
        key = data.draw(st.sampled_from(keys))
        out = dict(doc) if isinstance(doc, dict) else list(doc)
        if data.draw(st.integers(0, 5)) == 0:
            del out[key]  # type: ignore[arg-type]
        else:
            out[key] = _mutated(doc[key], data, values)  # type: ignore[index]
        return out
    return data.draw(values)


def _valid_plans() -> list[tuple[dict[str, Any], bool, bool]]:
    """``(document, load_plan reads it, sharded_train's --plan reads it)``: a full plan for 2
    ranks (both), its ``embark.plan --out`` document form (``--plan``), a short form
    (``load_plan``)."""
    from embark.planner.planner import plan_sharding

    full = plan_sharding(W, get_topology("cpu-local"), 64).to_dict()
    short = {"tables": [
        {"name": "t0", "ranks": [0, 1]}, {"name": "t1", "grid": [[0], [1]], "cluster": "unique"},
        *({"name": t.name, "ranks": [1]} for t in W.tables[2:-1]),
        {"name": W.tables[-1].name, "cluster": "data_parallel", "comm_dtype": "bf16"},
    ]}  # fmt: skip
    return [(full, True, True), ({"plan": full, "workload": "tiny"}, False, True),
            (short, True, False)]  # fmt: skip


VALID_PLANS = _valid_plans()
_PLAN_VALUES = _SMALL | st.sampled_from(["table_wise", "row_wise", "3d", "t0", "unique", "x"])


def _plan_readers(path: Path, manual: bool = True, cli: bool = True) -> None:
    if manual:
        _outcome(lambda: load_plan(path, W, get_topology("cpu-local")), str(path))
    if cli:
        _outcome(lambda: resolve_plan(ShardedRunConfig(plan=str(path)), W, 2, 64), str(path))


def test_the_valid_plans_load() -> None:
    with tempfile.TemporaryDirectory() as d:
        for i, (doc, manual, cli) in enumerate(VALID_PLANS):
            path = Path(d) / f"p{i}.json"
            path.write_text(json.dumps(doc))
            if manual:
                assert load_plan(path, W, get_topology("cpu-local")).world_size == 2
            if cli:
                assert resolve_plan(ShardedRunConfig(plan=str(path)), W, 2, 64).world_size == 2


@FUZZ
@given(data=st.binary(max_size=1500))
def test_plan_files_of_random_bytes(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        path.write_bytes(data)
        _plan_readers(path)


@FUZZ
@given(base=st.sampled_from(VALID_PLANS), data=st.data())
def test_plan_files_of_mutated_documents(
    base: tuple[dict[str, Any], bool, bool], data: st.DataObject
) -> None:
    doc, manual, cli = base
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        path.write_text(json.dumps(_mutated(doc, data, _PLAN_VALUES)))
        _plan_readers(path, manual, cli)


# -- checkpoints: Trainer.load_checkpoint ------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid checkpoint of the tiny model after one step (Adagrad state filled)."""
    from embark.data import SyntheticCTR

    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    trainer = Trainer(build_model(W, seed=0), TrainConfig(lr=0.05))
    trainer.fit(SyntheticCTR(W, batch_size=256, seed=0).batches(1), 1, progress=False)
    return trainer.save_checkpoint(path)


@pytest.fixture(scope="module")
def batch() -> Batch:
    """A training batch of the checkpoint's stream (its second)."""
    from embark.data import SyntheticCTR

    return next(iter(SyntheticCTR(W, batch_size=256, seed=0).batches(1, start=1)))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _record(ckpt: Path, name: str) -> None:
    """Make ``state.json`` record ``name``'s size and hash (so the reader gets past them)."""
    import hashlib

    state = json.loads((ckpt / "state.json").read_text())
    data = (ckpt / name).read_bytes()
    state["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "state.json").write_text(json.dumps(state))


def _load(ckpt: Path, named: Path) -> Trainer | None:
    return _outcome(lambda: Trainer.load_checkpoint(ckpt), str(named))


@FUZZ
@given(data=st.binary(max_size=1500))
def test_state_json_of_random_bytes(checkpoint: Path, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        ckpt = _copy(checkpoint, Path(d) / "ckpt")
        (ckpt / "state.json").write_bytes(data)
        _load(ckpt, ckpt / "state.json")


@FUZZ
@given(data=st.data())
def test_state_json_mutated(checkpoint: Path, batch: Batch, data: st.DataObject) -> None:
    """One node of a valid ``state.json`` replaced or dropped (the tensor files intact): the
    checks after the schema's (train config, workload, parameter groups, shapes) are reached."""
    with tempfile.TemporaryDirectory() as d:
        ckpt = _copy(checkpoint, Path(d) / "ckpt")
        state = json.loads((ckpt / "state.json").read_text())
        (ckpt / "state.json").write_text(json.dumps(_mutated(state, data, _SMALL)))
        trainer = _load(ckpt, ckpt)  # the folder: the message names it, or its state.json
        if trainer is None:
            return
        with _bounded():  # what loaded also trains (an option of the wrong kind would not)
            try:
                trainer.train_step(batch)
            except TrainingDiverged:  # a mutated learning rate may be huge
                pass
            except ValueError as err:  # a mutated batch_size: the stream changed
                assert "this trainer's data stream has" in str(err), err


_DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "X"]
_HEADER_VALUES = st.sampled_from(_DTYPES) | st.lists(st.integers(-1, 70), max_size=3) | _SMALL


@FUZZ
@given(
    name=st.sampled_from(["model.safetensors", "optimizer.safetensors"]),
    data=st.binary(max_size=1500),
)
def test_tensor_files_of_random_bytes(checkpoint: Path, name: str, data: bytes) -> None:
    """Random bytes recorded in ``state.json`` with their size and hash, so the tensor reader
    itself is reached."""
    with tempfile.TemporaryDirectory() as d:
        ckpt = _copy(checkpoint, Path(d) / "ckpt")
        (ckpt / name).write_bytes(data)
        _record(ckpt, name)
        _load(ckpt, ckpt)


@FUZZ
@given(name=st.sampled_from(["model.safetensors", "optimizer.safetensors"]), data=st.data())
def test_tensor_files_with_a_mutated_header(
    checkpoint: Path, name: str, data: st.DataObject
) -> None:
    """A real tensor file whose safetensors header has one node replaced or dropped (a dtype,
    a shape, an offset, a name), the tensor bytes unchanged, recorded in ``state.json``."""
    with tempfile.TemporaryDirectory() as d:
        ckpt = _copy(checkpoint, Path(d) / "ckpt")
        raw = (ckpt / name).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.dumps(_mutated(json.loads(raw[8 : 8 + n]), data, _HEADER_VALUES)).encode()
        (ckpt / name).write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n :])
        _record(ckpt, name)
        _load(ckpt, ckpt)


@pytest.mark.parametrize(
    ("edit", "msg"),
    [
        (
            lambda s: s["workload"]["tables"][0].pop("dim"),
            r"state.json': workload: table 't0': missing field\(s\) \['dim'\]",
        ),
        (
            lambda s: s["param_groups"][0].update(lr=[0.1]),
            r"state.json': param_groups\[0\].lr must be a finite number, got \[0.1\]",
        ),
        (
            lambda s: s["param_groups"][-1].update(eps=None),
            r"state.json': param_groups\[\d\].eps must be a finite number, got None",
        ),
        (
            lambda s: s["workload"].update(dense_features=1),
            r"model.safetensors': tensor 'bottom_mlp.0.weight' is \(64, 13\) torch.float32, "
            r"the model has \(64, 1\)",
        ),
    ],
    ids=["table-without-dim", "lr-a-list", "eps-null", "other-dense-width"],
)
def test_what_the_fuzz_found_is_a_clear_error(
    checkpoint: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], object], msg: str
) -> None:
    """Found by :func:`test_state_json_mutated`: a TypeError at load (a table without
    ``dim``), options that loaded and then failed inside the optimizer's step, a shape
    mismatch that did not name the checkpoint."""
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    state = json.loads((ckpt / "state.json").read_text())
    edit(state)
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=msg):
        Trainer.load_checkpoint(ckpt)


def test_a_valid_tensor_file_of_other_shapes_is_named(checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    save_file({"embeddings.t0.weight": torch.zeros(2, 2)}, ckpt / "model.safetensors")
    _record(ckpt, "model.safetensors")
    with pytest.raises(ValueError, match=f"checkpoint {str(ckpt)!r} does not fit the model"):
        Trainer.load_checkpoint(ckpt)


# -- the command lines: exit 2, one line -------------------------------------------------------
def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_prune_dlrm_with_a_binary_recipe_exits_2_with_one_line(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"\x00\xff\x80garbage\n\x01")
    p = _cli("recipes.prune_dlrm", "--recipe", str(recipe), "--out", str(tmp_path / "o"),
             cwd=tmp_path)  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"prune_dlrm.py: error: recipe file {recipe}: ")
    assert not (tmp_path / "o").exists()


def test_sharded_train_with_a_binary_plan_exits_2_with_one_line(tmp_path: Path) -> None:
    plan = tmp_path / "p.json"
    plan.write_bytes(b'{"world_size": \xff\xfe 1}')
    p = _cli("embark.sharded_train", "--steps", "1", "--plan", str(plan), cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert (
        p.stderr.strip().splitlines()[-1].startswith(f"ERROR __main__: error: --plan {str(plan)!r}")
    )
