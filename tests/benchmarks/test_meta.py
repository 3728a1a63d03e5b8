"""benchmarks.meta: results carry no path of the machine that wrote them."""

from __future__ import annotations

import json
import subprocess

from benchmarks import meta


def test_write_json_scrubs_absolute_paths(tmp_path):
    inside = str(meta.RESULTS_DIR / "x.json")
    out = meta.write_json(
        tmp_path / "r.json",
        [{"file": "/some/where/else/data.bin", "n": 3}],
        args={"out": inside, "name": "plain", "paths": ["/a/b/c.txt", "relative/p"]},
    )
    doc = json.loads(out.read_text())
    assert doc["args"] == {
        "out": "benchmarks/results/x.json",
        "name": "plain",
        "paths": ["c.txt", "relative/p"],
    }
    assert doc["rows"] == [{"file": "data.bin", "n": 3}]
    assert str(tmp_path) not in out.read_text()


def test_git_changed_names_uncommitted_code_but_not_results(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert meta.git_changed(tmp_path) == []
    (tmp_path / "code.py").write_text("a = 2\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"new": 1}')
    (tmp_path / "untracked.py").write_text("")
    assert meta.git_changed(tmp_path) == ["code.py"]
    assert meta.git_changed(tmp_path / "nowhere") is None
    assert "git_changed" in meta.machine()
