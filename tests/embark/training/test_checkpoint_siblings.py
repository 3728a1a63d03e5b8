"""A killed save's temporary folder is removed by the next save or load, never a live save's
(issue #22, item 9); the checkpoint folder is checked before training; a non-finite loss
stops training before it touches the weights."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.config import TrainConfig
from embark.training.trainer import Trainer, TrainingDiverged
from tests.embark.gloo_world import ROOT
from tests.unwritable import unwritable_folder

W = get_workload("tiny")

# saves a checkpoint whose model file is written, then blocks: a save to be killed
_STALLED_SAVE = """
import sys, time
import embark.training.checkpoint.store as ck
from embark import TrainConfig, Trainer, build_model, get_workload
write = ck.save_file
def stalled(tensors, filename, metadata=None):
    write(tensors, filename, metadata=metadata)
    print("writing", flush=True)
    time.sleep(600)
ck.save_file = stalled
Trainer(build_model(get_workload("tiny")), TrainConfig()).save_checkpoint(sys.argv[1])
"""


def _trainer() -> Trainer:
    return Trainer(build_model(W, seed=0), TrainConfig(lr=0.05))


def _siblings(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.parent.iterdir() if p.name.startswith(f".{ckpt.name}."))


def _start_stalled_save(ckpt: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED_SAVE, str(ckpt)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)  # a bound to detect a hang
    if not ready or proc.stdout.readline().strip() != "writing":
        proc.kill()
        proc.wait()
        pytest.fail("the stalled save did not start writing within 120 s")
    return proc


def test_a_killed_saves_temporary_folder_is_removed_by_the_next_save(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = _start_stalled_save(ckpt)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (left,) = _siblings(ckpt)
    assert left.startswith(".ckpt.tmp-")
    _trainer().save_checkpoint(ckpt)
    assert _siblings(ckpt) == []
    assert Trainer.load_checkpoint(ckpt).step == 0


def test_a_killed_saves_temporary_folder_is_removed_by_the_next_load(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _trainer().save_checkpoint(ckpt)
    proc = _start_stalled_save(ckpt)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_siblings(ckpt)) == 1
    Trainer.load_checkpoint(ckpt)
    assert _siblings(ckpt) == []


def test_a_save_in_progress_is_never_removed(tmp_path: Path) -> None:
    """Another process saving to the same folder: its temporary folder stays while it runs."""
    ckpt = tmp_path / "ckpt"
    proc = _start_stalled_save(ckpt)
    try:
        (live,) = _siblings(ckpt)
        _trainer().save_checkpoint(ckpt)
        Trainer.load_checkpoint(ckpt)
        assert _siblings(ckpt) == [live]
        assert (ckpt.parent / live / "model.safetensors").is_file()
    finally:
        proc.kill()
        proc.wait()


def test_only_this_hosts_dead_owners_siblings_go(tmp_path: Path) -> None:
    from embark.training.checkpoint import remove_stale_siblings

    ckpt = tmp_path / "ckpt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid, host = int(dead.stdout), socket.gethostname()
    names = {
        f".ckpt.tmp-{host}-{pid}-0000aaaa": False,  # killed save of this host: removed
        f".ckpt.tmp-{host}-{os.getpid()}-0000bbbb": True,  # this process: alive
        f".ckpt.tmp-other-host-{pid}-0000cccc": True,  # another host's: not ours to judge
        f".ckpt.old-{host}-{pid}-0000dddd": True,  # ckpt missing: may be the only copy
        ".ckpt.tmp-handmade": True,  # not named by a save
    }
    for name in names:
        (tmp_path / name).mkdir()
    removed = remove_stale_siblings(ckpt)
    assert [p.name for p in removed] == [f".ckpt.tmp-{host}-{pid}-0000aaaa"]
    assert sorted(_siblings(ckpt)) == sorted(n for n, kept in names.items() if kept)
    _trainer().save_checkpoint(ckpt)  # now the checkpoint exists: the dead .old- goes too
    assert f".ckpt.old-{host}-{pid}-0000dddd" not in _siblings(ckpt)


def test_fit_checks_the_checkpoint_dir_before_the_first_step(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    data = SyntheticCTR(W, batch_size=256, seed=0)
    for bad, msg in (
        (a_file / "ckpt", "is under .*a_file', which is a file"),
        (unwritable_folder(tmp_path) / "ckpt", "cannot be written"),
    ):
        cfg = TrainConfig(lr=0.05, checkpoint_every=1, checkpoint_dir=str(bad))
        trainer = Trainer(build_model(W, seed=0), cfg)
        with pytest.raises(ValueError, match=f"checkpoint_dir '{bad}' {msg}"):
            trainer.fit(data.batches(3), 3, progress=False)
        assert trainer.step == 0


def test_a_non_finite_loss_stops_before_the_step_changes_anything() -> None:
    data = SyntheticCTR(W, batch_size=256, seed=0)
    trainer = _trainer()
    trainer.fit(data.batches(2), 2, progress=False)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    sums = {id(p): st["sum"].clone() for p, st in trainer.optimizer.state.items()}
    batch = next(iter(data.batches(1, start=2)))
    batch.dense[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged, match="training diverged at step 3: its loss is nan"):
        trainer.train_step(batch)
    assert trainer.step == 2
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, st in trainer.optimizer.state.items():
        assert torch.equal(st["sum"], sums[id(p)])
    assert all(p.grad is None for p in trainer.model.parameters())
    assert trainer.train_step(next(iter(data.batches(1, start=3)))) > 0  # and it goes on
    assert trainer.step == 3


# a save killed (SIGKILL, by itself) between its two renames: the previous checkpoint is in an
# .old- sibling, the new one complete in a .tmp- sibling, and nothing at the checkpoint path
_KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from embark import TrainConfig, Trainer, build_model, get_workload
target = Path(sys.argv[1])
rename = Path.rename
def rename_or_die(self, dest):
    if Path(dest) == target:
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(self, dest)
Path.rename = rename_or_die
Trainer(build_model(get_workload("tiny"), seed=1), TrainConfig()).save_checkpoint(target)
"""


def _kill_between_renames(ckpt: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_BETWEEN_RENAMES, str(ckpt)], env=env, timeout=240
    )
    assert proc.returncode == -signal.SIGKILL
    assert not ckpt.exists()
    assert sorted(n.split("-")[0] for n in _siblings(ckpt)) == [".ckpt.old", ".ckpt.tmp"]


@pytest.mark.slow
def test_a_save_killed_between_its_renames_is_recovered_by_the_next_load(
    tmp_path: Path, caplog
) -> None:
    """The previous checkpoint (step 2) is moved back with a warning naming it: the resume
    continues from it, and the killed save's leftovers are gone. A fresh save then replaces
    it as it replaces any checkpoint, never deleting it as a leftover first."""
    ckpt = tmp_path / "ckpt"
    data = SyntheticCTR(W, batch_size=64, seed=0)
    trainer = _trainer()
    trainer.fit(data.batches(2), 2, progress=False)
    trainer.save_checkpoint(ckpt)
    want = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    _kill_between_renames(ckpt)
    (old,) = [n for n in _siblings(ckpt) if n.startswith(".ckpt.old-")]
    with caplog.at_level("WARNING", logger="embark.training.checkpoint.siblings"):
        resumed = Trainer.load_checkpoint(ckpt)
    assert resumed.step == 2
    assert all(torch.equal(v, want[k]) for k, v in resumed.model.state_dict().items())
    assert any(old in r.getMessage() and "moved it back" in r.getMessage() for r in caplog.records)
    assert _siblings(ckpt) == []


def test_a_fresh_save_after_a_killed_one_keeps_the_previous_checkpoint_until_replaced(
    tmp_path: Path,
) -> None:
    """A fresh run's save after the kill: the previous checkpoint is moved back first, so a
    failure of that save leaves it in place at the checkpoint path."""
    import embark.training.checkpoint.store as ck

    ckpt = tmp_path / "ckpt"
    _trainer().save_checkpoint(ckpt)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    old = tmp_path / f".ckpt.old-{socket.gethostname()}-{int(dead.stdout)}-0000eeee"
    ckpt.rename(old)  # what the killed save left (test above), without its .tmp- folder

    def disk_full(tensors, fp):
        raise OSError(28, "No space left on device")

    original = ck.write_tensors
    ck.write_tensors = disk_full
    try:
        with pytest.raises(OSError, match="No space left"):
            _trainer().save_checkpoint(ckpt)
    finally:
        ck.write_tensors = original
    assert Trainer.load_checkpoint(ckpt).step == 0 and _siblings(ckpt) == []


def test_a_previous_checkpoint_that_cannot_be_moved_back_is_named(tmp_path: Path) -> None:
    """An .old- folder of a save that still runs (here: this process) is not moved back; the
    load refuses naming it."""
    from embark.training.checkpoint.siblings import fresh_sibling

    ckpt = tmp_path / "ckpt"
    _trainer().save_checkpoint(ckpt)
    old = fresh_sibling(ckpt, "old")  # owned by this live process
    ckpt.rename(old)
    with pytest.raises(
        ValueError, match=rf"state.json is missing; .*previous checkpoint at \['{old}'\]"
    ):
        Trainer.load_checkpoint(ckpt)
    assert (old / "state.json").is_file()
