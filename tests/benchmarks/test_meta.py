"""benchmarks.meta: results carry no path of the machine that wrote them."""

from __future__ import annotations

import json

from benchmarks import meta


def test_write_json_scrubs_absolute_paths(tmp_path):
    inside = str(meta.RESULTS_DIR / "x.json")
    out = meta.write_json(
        tmp_path / "r.json",
        [{"file": "/some/where/else/data.bin", "n": 3}],
        args={"out": inside, "name": "plain", "paths": ["/a/b/c.txt", "relative/p"]},
    )
    doc = json.loads(out.read_text())
    assert doc["args"] == {"out": "benchmarks/results/x.json", "name": "plain", "paths": ["c.txt", "relative/p"]}
    assert doc["rows"] == [{"file": "data.bin", "n": 3}]
    assert str(tmp_path) not in out.read_text()
