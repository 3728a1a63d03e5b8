"""The name rule and the folder entries writers make of names (hps.names)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hps.names import NAME_RULE, check_name, entry, entry_exists, hidden_sibling, remove_entry


@pytest.mark.parametrize("good", ["t0", "_", "user_id", "dlrm-v2", "3d", "A" * 128])
def test_names_that_follow_the_rule(good: str) -> None:
    assert check_name(good, "table name") == good


@pytest.mark.parametrize(
    "bad", ["", "..", "../t", "/abs", "a/b", "x.y", "-t", "t 0", "t\n", "é", "A" * 129, 5, None]
)
def test_names_that_break_the_rule_are_refused_with_the_rule(bad: object) -> None:
    with pytest.raises(ValueError) as e:
        check_name(bad, "models[0].model")
    assert str(e.value) == f"models[0].model {bad!r} is not a valid name; expected {NAME_RULE}"


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "/abs", "a\0b"])
def test_an_entry_is_one_component_inside_its_folder(tmp_path: Path, bad: str) -> None:
    assert entry(tmp_path, "ps.json", "file") == tmp_path / "ps.json"
    with pytest.raises(ValueError, match="does not name an entry inside"):
        entry(tmp_path, bad, "table name")


def test_remove_entry_never_follows_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "f").write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    for name, target in [("dir", victim), ("file", victim / "f"), ("dangling", victim / "no")]:
        (out / name).symlink_to(target)
        assert entry_exists(out / name)
        remove_entry(out / name)
        assert not entry_exists(out / name)
    (out / "real").mkdir()
    (out / "real" / "inner").symlink_to(victim)  # a link inside a removed folder: unlinked
    remove_entry(out / "real")
    remove_entry(out / "absent")  # nothing there: no error
    assert sorted(p.name for p in victim.iterdir()) == ["f", "sub"] and not list(out.iterdir())


def test_hidden_siblings_are_fresh(tmp_path: Path) -> None:
    a, b = hidden_sibling(tmp_path / "t0", "tmp"), hidden_sibling(tmp_path / "t0", "tmp")
    assert a != b and a.parent == tmp_path and a.name.startswith(".t0.tmp-")
