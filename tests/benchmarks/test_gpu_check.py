"""The parts of the GPU check that run without a GPU: the sparsity split, the random TW layers
it benchmarks, its exit without a device, its time budget and timing arithmetic, the timing
loops (with stand-in CUDA events), the per-instance verification protocol (a faulting or hanging
instance costs only itself), and the benchmark's recording of errors in rows (with the kernel
replaced by its CPU emulation)."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from benchmarks.cutlass_kernels import gpu_bench, gpu_check, gpu_timing, gpu_verify
from cutlass_kernels.manifest import Arch, DType, Mainloop, manifest


@pytest.mark.parametrize(("s", "want"), [(0, 0.0), (75, 50.0), (50, 29.289), (90, 68.377)])
def test_split_sparsity_composes_to_the_target(s, want) -> None:
    step = gpu_verify.split_sparsity(s)
    assert step == pytest.approx(want, abs=1e-3)
    assert 1 - (1 - step / 100) ** 2 == pytest.approx(s / 100)


@pytest.mark.parametrize("s", [50, 75, 90])
def test_random_tw_layer_has_the_target_density(s) -> None:
    gen = torch.Generator().manual_seed(s)
    layout = gpu_verify.tw_layout(1024, 768, 128, s, gen, torch.float32)
    assert layout.density == pytest.approx(1 - s / 100, abs=0.01)
    dense = layout.to_dense()
    assert dense.shape == (1024, 768)
    kept_cols = (dense != 0).any(0).sum().item()
    assert kept_cols == round(768 * (1 - gpu_verify.split_sparsity(s) / 100))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a CUDA device")
def test_exits_3_without_a_cuda_device(capsys) -> None:
    assert gpu_check.main(["--out", "/dev/null"]) == 3
    assert "no CUDA device" in capsys.readouterr().err


# ----------------------------------------------------------------------------- budget, timing
class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_budget_caps_child_timeouts_at_what_is_left() -> None:
    clock = _Clock()
    b = gpu_timing.Budget(440, clock=clock)
    assert b.left() == 440 and not b.over()
    assert b.child_timeout(60) == 60
    clock.t += 400
    assert b.elapsed() == 400 and b.left() == 40
    assert b.child_timeout(60) == 40 and b.child_timeout(120) == 40
    clock.t += 45
    assert b.over() and b.child_timeout(60) == 0.0


def test_stall_covers_the_enqueue_and_is_clamped() -> None:
    assert gpu_timing.stall_us(0.0, 1) == 2000.0  # floor
    assert gpu_timing.stall_us(100.0, 20) == pytest.approx(1.5 * 20 * 120 + 1000)
    assert gpu_timing.stall_us(1e6, 100) == 300_000.0  # ceiling


def test_launch_bound_flag() -> None:
    assert gpu_timing.launch_bound(50.0, 40.0) and gpu_timing.launch_bound(40.0, 40.0)
    assert not gpu_timing.launch_bound(10.0, 40.0)
    t = gpu_timing.make_timing([30.0, 10.0, 20.0], hot_us=15.0, host_us=25.0, drained=False)
    assert (t.us, t.us_min, t.hot_us) == (20.0, 10.0, 15.0)
    assert t.launch_bound  # 25 µs of host per call vs a 20 µs (cold median) kernel
    assert not gpu_timing.make_timing([30.0], 15.0, 25.0, False).launch_bound
    assert t.fields("op_")["op_launch_bound"] is True
    with pytest.raises(ValueError):
        gpu_timing.make_timing([], 1.0, 1.0, False)


class _FakeEvent:
    """A CUDA event stand-in: records the wall clock; each timed op sleeps 1 ms."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    sleeps: list[int] = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return sleeps


def test_timer_loops_with_stand_in_events(fake_cuda) -> None:
    timer = gpu_timing.Timer("cpu", flush_bytes=1 << 16)
    timer.scratch.fill_(1.0)
    calls = []
    t = timer.time(lambda: (calls.append(1), time.sleep(0.001)), reps=4, warmup=2)
    assert len(calls) == 1 + 2 + 4 + 4  # first call, warm-up, hot loop, cold loop
    assert 0.9e3 <= t.us_min <= t.us < 50e3 and t.hot_us >= 0.9e3
    assert t.host_us >= 0.9e3 and t.launch_bound == (t.host_us >= t.us)  # the "op" is all host time
    assert float(timer.scratch.abs().sum()) == 0.0  # the flush ran
    assert len(fake_cuda) >= 3  # calibration + a busy-wait in front of each loop
    both = timer.interleaved({"a": lambda: time.sleep(0.002), "b": lambda: None}, reps=3)
    assert both["a"] > both["b"]


# ----------------------------------------------------------------------------- verification
def _kernels():
    ks = manifest(Arch.SM90A)
    ms = [k for k in ks if k.mainloop is Mainloop.SM80_MULTISTAGE and k.dtype is DType.F16][:2]
    gmma = [k for k in ks if k.mainloop is Mainloop.SM90_CPASYNC_GMMA and k.dtype is DType.F16][:2]
    return ms, gmma


def test_child_loop_records_an_error_against_its_instance_only(tmp_path) -> None:
    def verify_one(name):
        if name == "b":
            raise RuntimeError("CUDA error: too many resources requested for launch\nmore")
        return [{"check": "exact_vs_emulation", "kernel": name, "ok": True}], []

    out = tmp_path / "v.jsonl"
    assert gpu_verify.child_loop(["a", "b", "c"], verify_one, out, alive=lambda: True) == 0
    checks, failures, done, current = gpu_verify.read_progress(out)
    assert done == {"a", "b", "c"} and current is None
    assert {c["kernel"]: c["ok"] for c in checks} == {"a": True, "b": False, "c": True}
    assert failures == ["b: RuntimeError: CUDA error: too many resources requested for launch"]


def test_child_loop_stops_after_a_sticky_error(tmp_path) -> None:
    def verify_one(name):
        if name == "b":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [{"check": "x", "kernel": name, "ok": True}], []

    out = tmp_path / "v.jsonl"
    assert gpu_verify.child_loop(["a", "b", "c"], verify_one, out, alive=lambda: False) == 2
    _, failures, done, current = gpu_verify.read_progress(out)
    assert done == {"a", "b"} and current is None and "illegal memory access" in failures[0]


def test_read_progress_names_the_unfinished_instance(tmp_path) -> None:
    out = tmp_path / "v.jsonl"
    out.write_text(
        '{"start": "a"}\n{"check": {"kernel": "a", "ok": true}}\n{"done": "a"}\n'
        '{"start": "b"}\n{"che'
    )  # cut short by the crash
    checks, _, done, current = gpu_verify.read_progress(out)
    assert done == {"a"} and current == "b" and len(checks) == 1
    assert gpu_verify.read_progress(tmp_path / "missing.jsonl") == ([], [], set(), None)


# Stand-in children speaking the JSON-lines protocol. This one passes every sm80_multistage
# instance and dies (SIGABRT, like a kernel fault taking the process down) on the gmma ones
# before reporting anything.
_CHILD = r"""
import json, os, sys
names = sys.argv[sys.argv.index("--verify-kernels") + 1].split(",")
out = sys.argv[sys.argv.index("--verify-out") + 1]
if any("_gmma_" in n for n in names):
    sys.stderr.write("CUDA error: an illegal memory access was encountered\n")
    sys.stderr.flush()
    os.abort()
with open(out, "a") as f:
    for n in names:
        f.write(json.dumps({"start": n}) + "\n")
        f.write(json.dumps({"check": {"check": "exact_vs_emulation", "kernel": n, "ok": True}}) + "\n")
        f.write(json.dumps({"done": n}) + "\n")
"""

# This one dies on (or hangs in) instance number 1 of its list, after reporting instance 0;
# it records the --built list it was given in its check rows.
_CHILD_DIES_ON_ONE = r"""
import json, os, sys, time
names = sys.argv[sys.argv.index("--verify-kernels") + 1].split(",")
out = sys.argv[sys.argv.index("--verify-out") + 1]
built = sys.argv[sys.argv.index("--built") + 1] if "--built" in sys.argv else None
with open(out, "a") as f:
    for n in names:
        f.write(json.dumps({"start": n}) + "\n")
        f.flush()
        if n == BAD:
            if HANG:
                time.sleep(30)
            os.abort()
        f.write(json.dumps({"check": {"check": "x", "kernel": n, "ok": True, "built": built}}) + "\n")
        f.write(json.dumps({"done": n}) + "\n")
        f.flush()
"""


def test_a_crashing_main_loop_is_marked_broken_and_the_rest_verified() -> None:
    ms, gmma = _kernels()
    failures: list[str] = []
    checks = gpu_check.verify_in_children(
        ms + gmma, failures, timeout_s=60, child_cmd=[sys.executable, "-c", _CHILD]
    )
    ok = {c["kernel"] for c in checks if c["ok"]}
    bad = {c["kernel"] for c in checks if not c["ok"]}
    assert ok == {k.name for k in ms}
    assert bad == {k.name for k in gmma}
    assert len(failures) == 1 and "sm90_cpasync_gmma" in failures[0]
    assert "illegal memory access" in failures[0]


@pytest.mark.parametrize("hang", [False, True])
def test_a_fault_or_hang_costs_only_the_instance_it_hit(hang) -> None:
    ks = [
        k
        for k in manifest(Arch.SM90A)
        if k.mainloop is Mainloop.SM80_MULTISTAGE and k.dtype is DType.F16
    ][:4]
    names = [k.name for k in ks]
    child = _CHILD_DIES_ON_ONE.replace("BAD", repr(names[1])).replace("HANG", str(hang))
    failures: list[str] = []
    built = ["x_first", *names]
    checks = gpu_check.verify_in_children(
        ks,
        failures,
        timeout_s=3 if hang else 60,
        child_cmd=[sys.executable, "-c", child],
        built=built,
    )
    assert {c["kernel"]: c["ok"] for c in checks} == {n: n != names[1] for n in names}
    assert len(failures) == 1 and names[1] in failures[0]
    assert ("timed out after 3 s" if hang else "exit") in failures[0]
    assert all(c["built"] == ",".join(built) for c in checks if c["ok"])  # same ext in every child


def test_a_main_loop_that_hangs_every_time_is_given_up_after_two() -> None:
    ks = [
        k
        for k in manifest(Arch.SM90A)
        if k.mainloop is Mainloop.SM80_MULTISTAGE and k.dtype is DType.F16
    ][:4]
    child = _CHILD_DIES_ON_ONE.replace("n == BAD", "True").replace("HANG", "True")
    failures: list[str] = []
    t0 = time.perf_counter()
    checks = gpu_check.verify_in_children(
        ks, failures, timeout_s=1, child_cmd=[sys.executable, "-c", child]
    )
    assert time.perf_counter() - t0 < 10  # two time-outs, not four
    assert [c["ok"] for c in checks] == [False] * 4
    assert ks[0].name in failures[0] and ks[1].name in failures[1]
    assert "2 instance(s) marked broken" in failures[2] and len(failures) == 3


def test_a_hanging_child_times_out() -> None:
    ms, _ = _kernels()
    failures: list[str] = []
    checks = gpu_check.verify_in_children(
        ms, failures, timeout_s=1, child_cmd=[sys.executable, "-c", "import time; time.sleep(30)"]
    )
    assert [c["ok"] for c in checks] == [False] * len(ms)
    assert "timed out after 1 s" in failures[0]


def test_no_child_starts_once_the_budget_is_spent() -> None:
    ms, _ = _kernels()
    failures: list[str] = []
    budget = gpu_timing.Budget(0.0)
    checks = gpu_check.verify_in_children(
        ms,
        failures,
        timeout_s=60,
        budget=budget,
        child_cmd=[sys.executable, "-c", "raise SystemExit(9)"],
    )
    assert [c["ok"] for c in checks] == [False] * len(ms)
    assert "out of time" in failures[0]


def test_verification_groups_by_mainloop_and_dtype() -> None:
    ks = manifest(Arch.SM90A)
    failures: list[str] = []
    checks = gpu_check.verify_in_children(
        ks, failures, timeout_s=60, child_cmd=[sys.executable, "-c", _CHILD]
    )
    assert len(failures) == 2  # sm90_cpasync_gmma/f16 and sm90_cpasync_gmma/bf16
    assert {f.split(":")[0] for f in failures} == {
        "sm90_cpasync_gmma/f16",
        "sm90_cpasync_gmma/bf16",
    }
    assert sum(c["ok"] for c in checks) == sum(k.mainloop is Mainloop.SM80_MULTISTAGE for k in ks)


# ----------------------------------------------------------------------------- benchmark logic
def test_build_order_puts_the_benchmarked_instances_first() -> None:
    ks = manifest(Arch.SM90A)
    order = gpu_check.build_order(ks, (torch.bfloat16,))
    assert sorted(k.name for k in order) == sorted(k.name for k in ks)
    n = sum(k.dtype is DType.BF16 and k.tile_g == 128 for k in ks)
    assert all(k.dtype is DType.BF16 and k.tile_g == 128 for k in order[:n])
    assert order[n].dtype is DType.BF16 and order[n].tile_g == 64
    both = gpu_check.build_order(ks, (torch.float16, torch.bfloat16))
    assert [k.dtype for k in both[:2]] == [DType.F16, DType.F16] and both[-1].dtype is DType.BF16


def test_sampled_columns_include_the_last_batch_block() -> None:
    cols = gpu_bench.sample_columns(12800)
    assert cols[0] == 0 and 6400 in cols and cols[-256:] == list(range(12544, 12800))
    assert gpu_bench.sample_columns(5) == [0, 1, 2, 3, 4]


def test_check_close_flags_a_wrong_output() -> None:
    ref = torch.randn(8, 16)
    assert gpu_verify.check_close(ref.half(), ref, torch.float16)[0]
    bad = ref.half().clone()
    bad[-1, -1] += 1.0
    ok, err = gpu_verify.check_close(bad, ref, torch.float16)
    assert not ok and err == pytest.approx(1.0, abs=0.01)
    nan = ref.half().clone()
    nan[0, 0] = float("nan")
    assert not gpu_verify.check_close(nan, ref, torch.float16)[0]


def _jobs(n: int = 3):
    return [(f"s{i}", 8, 8, 8, torch.float16) for i in range(n)]


def test_a_failing_shape_leaves_an_error_row_and_the_run_goes_on() -> None:
    def bench_one(name, M, K, N, dtype):
        if name == "s1":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\ndetails")
        return [{"shape": name, "dtype": "float16", "method": "dense_cublas", "us": 1.0}]

    rows, failures, skipped, saves = [], [], [], []
    gpu_check.run_shapes(
        _jobs(),
        bench_one,
        gpu_timing.Budget(100),
        rows,
        failures,
        skipped,
        lambda: saves.append(len(rows)),
    )
    assert [r["shape"] for r in rows] == ["s0", "s1", "s2"]
    assert "out of memory" in rows[1]["error"] and rows[1]["ok"] is False and "us" not in rows[1]
    assert len(failures) == 1 and saves == [1, 2, 3]  # saved after every shape
    assert gpu_check.exit_status(rows, failures) == 1


def test_a_lost_cuda_context_ends_the_run() -> None:
    def bench_one(name, M, K, N, dtype):
        raise gpu_verify.CudaContextLost("illegal memory access")

    rows, failures, skipped = [], [], []
    gpu_check.run_shapes(
        _jobs(), bench_one, gpu_timing.Budget(100), rows, failures, skipped, lambda: None
    )
    assert len(rows) == 1 and skipped == ["s1/float16", "s2/float16"]
    assert gpu_check.exit_status(rows, failures) == gpu_check.EXIT_NO_TIMING


def test_exit_nonzero_when_every_shape_is_skipped() -> None:
    rows, failures, skipped = [], [], []
    gpu_check.run_shapes(
        _jobs(),
        lambda *a: pytest.fail("must not run"),
        gpu_timing.Budget(0.0),
        rows,
        failures,
        skipped,
        lambda: None,
    )
    assert rows == [] and skipped == ["s0/float16", "s1/float16", "s2/float16"]
    assert gpu_check.exit_status(rows, failures) == gpu_check.EXIT_NO_TIMING != 0
    assert gpu_check.exit_status([{"us": 1.0}], []) == 0


def test_time_candidates_records_errors_per_candidate() -> None:
    ks, _ = _kernels()
    a, b = ks

    def time_one(k):
        if k is a:
            raise RuntimeError("launch failed: invalid argument")
        return gpu_timing.make_timing([5.0], 5.0, 1.0, False)

    timings, max_err, errors = gpu_bench.time_candidates(
        ks, time_one, lambda k: (True, 0.0), lambda: True
    )
    assert list(timings) == [b.name] and "invalid argument" in errors[a.name]
    timings, _, errors = gpu_bench.time_candidates(
        [b], time_one, lambda k: (False, 3.0), lambda: True
    )
    assert timings == {} and "max abs err 3" in errors[b.name]
    with pytest.raises(gpu_verify.CudaContextLost):
        gpu_bench.time_candidates([a], time_one, lambda k: (True, 0.0), lambda: False)


class _FakeTimer:
    """Calls each op (so outputs exist) and returns fixed figures: TW 10 µs, dense 30 µs."""

    def time(self, fn, reps):
        fn()
        return gpu_timing.make_timing([10.0, 12.0], 9.0, 2.0, False)

    def interleaved(self, fns, reps):
        for fn in fns.values():
            fn()
        return {k: 30.0 if k == "dense" else 10.0 for k in fns}


def test_bench_shape_on_the_emulation_records_errors_in_rows(monkeypatch) -> None:
    from cutlass_kernels import launch
    from cutlass_kernels.reference import emulate

    ks = [k for k in manifest(Arch.SM90A) if k.dtype is DType.F16 and k.tile_g == 128]
    raising, wrong = ks[0].name, ks[1].name

    def fake_gemm(launch, *, kernel=None, ext=None):
        if kernel.name == raising:
            raise RuntimeError("CUDA error: too many resources requested for launch")
        emulate(launch, tile_m=kernel.tile_g)
        if kernel.name == wrong:
            launch.yt[:, launch.rows - 1] += 1.0  # the last batch row is off
        return launch.yt

    monkeypatch.setattr(launch, "tw_gemm_kmajor", fake_gemm)
    monkeypatch.setattr(launch, "select_for", lambda launch, ext: ks[2])
    failures: list[str] = []
    rows = gpu_check.bench_shape(
        None,
        ks,
        "tiny",
        300,
        256,
        384,
        torch.float16,
        _FakeTimer(),
        2,
        failures,
        broken=set(),
        device="cpu",
    )
    dense, tw, s24 = rows[0], rows[1:4], rows[4]
    assert dense["method"] == "dense_cublas" and dense["us"] == 11.0
    for r in tw:
        assert r["method"] == "tw_cutlass" and r["us"] == 10.0 and r["dense_us"] == 30.0
        assert r["ratio"] == 3.0 and r["fraction_of_ideal"] == pytest.approx(3.0 * r["density"])
        assert r["max_abs_err"] < 1e-2 and r["op_max_abs_err"] < 1e-2
        assert r["launch_bound"] is False and r["op_launch_bound"] is False
        assert set(r["candidate_errors"]) == {raising, wrong} and r["ok"] is False
        assert r["candidate_max_abs_err"][wrong] >= 0.5 and r["kernel"] not in (raising, wrong)
        assert r["selected_kernel"] == ks[2].name and r["selected_us"] == 11.0
    assert len(failures) == 3 and all(raising in f and wrong in f for f in failures)
    assert s24["method"] == "2:4_semi_structured" and "error" in s24  # no 2:4 on the CPU
    json.dumps(rows)  # rows are plain data


def test_bench_shape_without_verified_instances_still_times_dense() -> None:
    ks = [k for k in manifest(Arch.SM90A) if k.dtype is DType.F16 and k.tile_g == 128]
    failures: list[str] = []
    rows = gpu_check.bench_shape(
        None,
        ks,
        "tiny",
        64,
        64,
        128,
        torch.float16,
        _FakeTimer(),
        2,
        failures,
        broken={k.name for k in ks},
        device="cpu",
    )
    assert rows[0]["us"] == 11.0 and all("failed verification" in r["error"] for r in rows[1:4])
    assert len(failures) == 3


@pytest.fixture
def fake_gpu_run(monkeypatch):
    """``main()`` with the GPU pieces stubbed: a fake extension whose kernel is the emulation
    (one instance "failed to compile"), verification passing, tiny shapes run on the CPU."""
    from cutlass_kernels import build, launch, toolchain
    from cutlass_kernels.reference import emulate

    ks = manifest(Arch.SM90A)
    calls: dict[str, object] = {}

    class FakeExt:
        failed = {ks[-1].name: "nvcc failed"}

        @staticmethod
        def instances():
            return [k.name for k in ks[:-1]]

    def load_extension(arch, kernels=None, *, skip_failed=False, **_):
        calls["build_order"] = [k.name for k in kernels]
        if calls.get("build_raises"):
            raise RuntimeError("link error: undefined symbol")
        return FakeExt()

    def verify(kernels, failures, timeout_s, child_cmd=None, built=None, budget=None):
        calls["built"] = built
        return [{"check": "x", "kernel": k.name, "ok": True} for k in kernels]

    orig_bench = gpu_check.bench_shape
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake H200")
    monkeypatch.setattr(gpu_check, "_import_cutlass_library", lambda: None)
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: "/nonexistent/nvcc")
    monkeypatch.setattr(toolchain, "nvcc_version", lambda nvcc: (13, 0))
    monkeypatch.setattr(toolchain, "device_arch", lambda *a: Arch.SM90A)
    monkeypatch.setattr(build, "load_extension", load_extension)
    monkeypatch.setattr(
        launch,
        "tw_gemm_kmajor",
        lambda launch, *, kernel=None, ext=None: emulate(launch, tile_m=kernel.tile_g),
    )
    monkeypatch.setattr(launch, "select_for", lambda launch, ext: None)
    monkeypatch.setattr(gpu_check, "verify_in_children", verify)
    monkeypatch.setattr(gpu_check, "gpu_warmup", lambda: 150.0)
    monkeypatch.setattr(
        gpu_check, "Timer", lambda device: type("T", (_FakeTimer,), {"cycles_per_us": 1.0})()
    )
    monkeypatch.setattr(gpu_check, "SHAPES", [("tiny_a", 200, 128, 256), ("tiny_b", 64, 256, 128)])
    monkeypatch.setattr(gpu_check, "bench_shape", lambda *a: orig_bench(*a, device="cpu"))
    return calls, ks


def test_main_end_to_end_with_stubs(fake_gpu_run, tmp_path) -> None:
    calls, ks = fake_gpu_run
    out = tmp_path / "r.json"
    assert gpu_check.main(["--out", str(out), "--budget-s", "300"]) == 1  # the compile failure
    doc = json.loads(out.read_text())
    assert doc["stage"] == "done" and doc["dtypes"] == ["float16", "bfloat16"]
    assert doc["failures"] == [f"{ks[-1].name}: compile error (left out of the build)"]
    tw = [r for r in doc["rows"] if r["method"] == "tw_cutlass"]
    assert len(tw) == 2 * 2 * 3 and all(r["ok"] and r["ratio"] == 3.0 for r in tw)
    assert [r["dtype"] for r in doc["rows"][:5]] == ["float16"] * 5  # fp16 first
    # the child gets the parent's built instances in build order: the same extension
    assert calls["built"] == [n for n in calls["build_order"] if n != ks[-1].name]


def test_main_writes_json_when_the_build_fails(fake_gpu_run, tmp_path) -> None:
    calls, _ = fake_gpu_run
    calls["build_raises"] = True
    out = tmp_path / "r.json"
    assert gpu_check.main(["--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["stage"] == "build failed" and "undefined symbol" in doc["build_error"]


def test_main_exits_nonzero_when_every_shape_is_skipped(fake_gpu_run, tmp_path) -> None:
    out = tmp_path / "r.json"
    assert (
        gpu_check.main(["--out", str(out), "--budget-s", "0", "--dtype", "f16"])
        == gpu_check.EXIT_NO_TIMING
    )
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and doc["skipped_shapes"] == ["tiny_a/float16", "tiny_b/float16"]
