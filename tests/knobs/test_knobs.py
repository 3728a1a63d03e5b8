"""The one command-line idiom (:mod:`knobs`): a leaf every package may import, and the
options a knob may carry beyond its type (an argparse type, choices, required)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass

import pytest

from knobs import add_knobs, from_namespace, knob, parse_knobs


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


@dataclass(frozen=True)
class Demo:
    preset: str = knob("a", "a preset", choices=("a", "b"), required=True)
    count: int = knob(1, "how many", parse=_positive)
    level: str = knob("info", "a level", parse=str.lower, choices=("debug", "info"))


def test_knobs_imports_nothing_of_ours() -> None:
    code = (
        "import sys, knobs; ours = {'embark', 'hps', 'recipes', 'tilesparse', 'export', "
        "'cutlass_kernels', 'torch'}; print(sorted(ours & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_choices_and_required_reach_argparse() -> None:
    cfg = parse_knobs(Demo, ["--preset", "b", "--count", "3", "--level", "DEBUG"])
    assert cfg == Demo(preset="b", count=3, level="debug")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: --preset"),
        (["--preset", "c"], "argument --preset: invalid choice: 'c'"),
        (["--preset", "a", "--count", "0"], "argument --count: expected an integer >= 1, got '0'"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_knobs(Demo, argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_required_and_defaults() -> None:
    p = argparse.ArgumentParser()
    add_knobs(p, Demo)
    text = p.format_help()
    assert "a preset (required)" in text and "how many (default: 1)" in text
    ns = p.parse_args(["--preset", "a"])
    assert from_namespace(Demo, ns) == Demo()
