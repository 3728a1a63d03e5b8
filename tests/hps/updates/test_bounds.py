"""Online update rows that are finite but would overflow the model's float32 arithmetic (a
diverged trainer's 3e38) are refused naming the key and the bound; rows at the bound pass, and
a dot product of two rows at the bound is finite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hps.session import LookupSession, SessionTable
from hps.storage.volatile import HashMapBackend
from hps.updates import FileLogSource, InvalidUpdateError, UpdateApplier
from hps.updates.bounds import FLOAT32_MAX, check_row_bound, row_value_bound

DIM = 16


@pytest.mark.parametrize("dim", [1, 16, 128, 256])
def test_the_bound_keeps_a_dot_product_of_two_rows_finite(dim: int) -> None:
    b = np.float32(row_value_bound(dim))
    row = np.full(dim, b, np.float32)
    assert np.isfinite(np.dot(row, row)) and np.isfinite(b * b * dim)
    assert row_value_bound(dim) ** 2 * dim == pytest.approx(FLOAT32_MAX, rel=1e-9)
    check_row_bound(np.array([1]), row[None], "update for 't':")  # at the bound: accepted


def test_an_update_of_3e38_is_refused_naming_key_and_bound(tmp_path: Path) -> None:
    keys = np.arange(4, dtype=np.int64)
    vdb = HashMapBackend(num_partitions=1)
    vdb.create_table("t", DIM)
    vdb.insert("t", keys, np.zeros((4, DIM), np.float32))
    s = LookupSession([SessionTable("t", DIM, 0.0, 1000, None)], vdb, None)
    ap = UpdateApplier(FileLogSource(tmp_path / "u.log"), [s], vdb, offset_file=tmp_path / "off")
    rows = np.ones((2, DIM), np.float32)
    rows[1, 5] = -3e38
    with pytest.raises(InvalidUpdateError, match=r"the row of key 3 holds 3e\+38, beyond the bound 4\.6\d+e\+18 \(sqrt\(FLT_MAX / dim\), dim 16\)"):  # fmt: skip
        ap.apply({"t": (np.array([2, 3], np.int64), rows)}, "1")
    assert (vdb.lookup("t", keys)[0] == 0).all() and ap.offset is None  # nothing applied
    assert torch.equal(s.lookup("t", keys), torch.zeros(4, DIM))
    s.close()
