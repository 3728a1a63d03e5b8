from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import pytest

from recipes.cli import knob, parse_knobs


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Knobs:
    """Example recipe."""

    steps: int = knob(10, "optimizer steps")
    lr: float = knob(0.5, "learning rate")
    name: str = knob("x", "a name")
    widths: tuple[int, ...] = knob((4, 2), "layer widths")
    color: Color = knob(Color.RED, "a color")
    mode: Literal["a", "b"] = knob("a", "a mode")
    out: str | None = knob(None, "output folder")
    limit: int | None = knob(3, "optional limit")
    fast: bool = knob(False, "go fast")
    tint: Color | None = knob(Color.BLUE, "optional color; none = no tint")
    sizes: Literal[1, 2] = knob(1, "an int literal")

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")


def test_defaults_round_trip_and_help_shows_them(capsys):
    assert parse_knobs(Knobs, []) == Knobs()
    with pytest.raises(SystemExit):
        parse_knobs(Knobs, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("optimizer steps (default: 10)", "(default: 4 2)", "(default: red)",
                  "{red,blue}", "--fast, --no-fast", "(default: None)"):  # fmt: skip
        assert shown in text, shown


def test_every_type_parses():
    cfg = parse_knobs(
        Knobs,
        ["--steps", "3", "--lr", "1e-3", "--widths", "8", "4", "1", "--color", "blue",
         "--mode", "b", "--out", "runs/x", "--limit", "none", "--fast"],
    )  # fmt: skip
    assert cfg == Knobs(3, 1e-3, "x", (8, 4, 1), Color.BLUE, "b", "runs/x", None, True)


@pytest.mark.parametrize(("text", "want"), [("none", None), ("None", None), ("red", Color.RED)])
def test_optional_enum_takes_none_and_members(text, want):
    cfg = parse_knobs(Knobs, ["--tint", text])
    assert cfg.tint is want


def test_int_literal_parses_to_int():
    assert parse_knobs(Knobs, ["--sizes", "2"]).sizes == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--color", "green"], "argument --color: invalid choice: 'green' (choose from red, blue)"),
        (
            ["--tint", "green"],
            "argument --tint: invalid choice: 'green' (choose from red, blue, none)",
        ),
        (["--color", "none"], "argument --color: invalid choice: 'none' (choose from red, blue)"),
        (["--sizes", "3"], "argument --sizes: invalid choice: '3' (choose from 1, 2)"),
    ],
)
def test_choice_errors_list_values_not_enum_reprs(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_knobs(Knobs, argv)
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "<Color" not in err


def test_help_shows_choices_by_value(capsys):
    with pytest.raises(SystemExit):
        parse_knobs(Knobs, ["--help"])
    text = capsys.readouterr().out
    assert "--tint {red,blue,none}" in text and "--sizes {1,2}" in text and "<Color" not in text


@pytest.mark.parametrize("argv", [["--steps", "x"], ["--color", "green"], ["--steps", "-1"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_knobs(Knobs, argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_mutable_default_is_refused():
    with pytest.raises(ValueError, match="immutable"):
        knob([1, 2], "a list")


def test_check_errors_are_usage_errors(tmp_path, capsys):
    """``check`` runs on the parsed knobs; its ValueError / OSError is a usage error (exit 2)."""

    def check(k: Knobs) -> None:
        if k.name == "bad":
            raise ValueError("--name must not be 'bad'")
        if k.name == "file":
            (tmp_path / "missing.yaml").read_text()

    assert parse_knobs(Knobs, ["--name", "ok"], check=check).name == "ok"
    for name, msg in (
        ("bad", "error: --name must not be 'bad'"),
        ("file", "No such file or directory"),
    ):
        with pytest.raises(SystemExit) as info:
            parse_knobs(Knobs, ["--name", name], check=check)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err
