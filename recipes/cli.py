"""Command lines of the recipes: a dataclass of knobs (the project's one idiom, :mod:`knobs`).

A recipe declares its knobs once, as a dataclass whose fields carry defaults and help::

    @dataclass(frozen=True)
    class Knobs:
        steps: int = knob(3000, "optimizer steps")
        lr: float = knob(0.03, "dense learning rate")
        tables: tuple[int, ...] = knob((10, 20), "rows per table")
        out: str | None = knob(None, "output folder; default runs/<recipe>-<timestamp>")
        progress: bool = knob(True, "show a progress bar")

    def main(cfg: Knobs) -> dict: ...

    if __name__ == "__main__":
        main(parse_knobs(Knobs, description="what the recipe does"))

``parse_knobs`` builds an ``argparse`` parser with one ``--flag`` per field (``--foo-bar`` for
``foo_bar``), the field's default shown in ``--help``, and returns the dataclass instance.
Supported field types: ``int``, ``float``, ``str``, ``bool`` (``--x`` / ``--no-x``), a
``StrEnum`` or ``Literal[...]`` (choices), ``tuple[T, ...]`` (space-separated values) and
``T | None`` (the word ``none`` gives ``None``).

Bounds are declared with the knob and shown in ``--help``; :func:`check_knobs` (called by the
dataclass's ``__post_init__``) enforces them and the field's type, so a value out of range is
a ``ValueError`` naming the flag, and on the command line a usage error (exit 2)::

    batch_size: int = knob(512, "samples per step", ge=1, le=MAX_BATCH_SIZE)
    lr: float = knob(0.02, "learning rate", gt=0)

A recipe's output folder is an :class:`OutFolder`: ``--out`` must be a folder that can be
written, and one that holds an earlier run is refused unless ``--overwrite`` (remove what that
run wrote: the entries its recipe's ``outputs`` match; refused, listing them, while the folder
also holds entries the run did not write, such as the user's notes) or
``--resume`` (continue it, for recipes that can) is given; the default is a fresh
``runs/<recipe>-<UTC timestamp>``.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from embark import TrainingDiverged, check_output_dir
from knobs import (
    Bounds,
    add_knobs,
    check_knobs,
    flag,
    from_namespace,
    knob,
    parse_knobs,
)

__all__ = [
    "RUN_MARKER",
    "Bounds",
    "OutFolder",
    "add_knobs",
    "check_knobs",
    "flag",
    "foreign_entries",
    "from_namespace",
    "knob",
    "parse_knobs",
    "run_recipe",
]

T = TypeVar("T")


def run_recipe(main: Callable[[T], object], cfg: T) -> int:
    """Run a recipe's ``main`` on its parsed knobs, for its command line: exit status 0 when
    it finishes; 1, with one line saying where and what was saved (the exception's notes),
    when training diverged (:class:`~embark.training.trainer.TrainingDiverged`)."""
    try:
        main(cfg)
    except TrainingDiverged as err:
        notes = "; ".join(getattr(err, "__notes__", []))
        prog = Path(sys.argv[0]).name
        print(f"{prog}: error: {err}" + (f"; {notes}" if notes else ""), file=sys.stderr)
        return 1
    return 0


# -- the output folder --------------------------------------------------------------------
#: Written into every run's folder when it is created: ``{"recipe", "created", "outputs"}``
#: (``outputs``: the patterns of the entries that recipe writes). Only a folder holding it is
#: cleared by ``--overwrite`` or continued by ``--resume``, so neither can empty a folder no
#: recipe made (``--out . --overwrite`` in a repository is refused), and ``--overwrite``
#: removes only the entries its ``outputs`` match.
RUN_MARKER = ".recipe-run.json"
_LISTED = 4  # entries named in the message about a non-empty --out
_LISTED_FOREIGN = 20  # entries named when --overwrite refuses files a run did not write


def _listing(names: list[str]) -> str:
    more = len(names) - _LISTED
    return ", ".join(names[:_LISTED]) + (f" and {more} more" if more > 0 else "")


def foreign_entries(names: Sequence[str], outputs: Sequence[str]) -> list[str]:
    """The entries of ``names`` (folders with a trailing ``/``) that no pattern of ``outputs``
    matches (and that are not the run marker): what a run with those outputs did not write."""
    return [
        n
        for n in names
        if n.rstrip("/") != RUN_MARKER
        and not any(fnmatch.fnmatchcase(n.rstrip("/"), o) for o in outputs)
    ]


@dataclass(frozen=True)
class OutFolder:
    """A recipe run's output folder (``--out``) and what the run may do to an earlier one.

    Args:
        recipe: the recipe's name (``"train_dlrm"``): the default folder's prefix and the
            marker's ``recipe``.
        out: the folder; ``None``: a fresh ``runs/<recipe>-<UTC timestamp>`` (``-2``, ``-3``
            ... when a run of the same second took it).
        overwrite: clear a folder that holds an earlier run (only what is inside it: links
            are removed, never followed).
        resume: continue the run in ``out`` (keep its files); ``None``: the recipe cannot
            resume, and its messages do not offer ``--resume``.
        outputs: ``fnmatch`` patterns of the entries (files and folders directly in ``out``)
            this recipe's runs write, its temporaries included (``".checkpoint.*"``); recorded
            in the marker, so a later ``--overwrite`` removes exactly what the earlier run
            wrote, whichever recipe that was.
    """

    recipe: str
    out: str | None
    overwrite: bool = False
    resume: bool | None = None
    outputs: tuple[str, ...] = ()

    def check(self) -> None:
        """Check, before anything runs, that the run can write its folder.

        Raises:
            ValueError: naming ``--out``: a file, a path under a file, a folder that cannot
                be created or written; a non-empty folder without ``--overwrite`` or
                ``--resume``; ``--overwrite`` on a folder no recipe run made; ``--resume``
                without an earlier run of this recipe there; both flags together.
        """
        if self.overwrite and self.resume:
            raise ValueError("--overwrite and --resume exclude each other: pick one")
        if self.out is None:
            if self.resume:
                raise ValueError("--resume needs --out: the folder of the run to continue")
            check_output_dir("runs", "the default --out folder")
            return
        path = Path(self.out)
        check_output_dir(path, "--out")
        names = self._entries(path)
        if self.resume:
            self._check_resumable(path, names)
        elif names and not self.overwrite:
            resume = ", --resume to continue it" if self.resume is not None else ""
            raise ValueError(
                f"--out {self.out!r} is not empty (it holds {_listing(names)}): pass "
                f"--overwrite to replace the run there{resume}, or choose another folder"
            )
        elif names and RUN_MARKER not in names:
            raise ValueError(
                f"--out {self.out!r} holds files no recipe run wrote ({_listing(names)}): "
                "--overwrite only clears a recipe's own output folder; empty it yourself or "
                "choose another folder"
            )
        elif names:
            self._check_only_run_outputs(path, names)

    def open(self) -> Path:
        """:meth:`check`, then the folder ready for the run: created (with its marker),
        cleared first with ``overwrite``, kept as it is with ``resume``."""
        self.check()
        if self.out is None:
            return self._fresh()
        path = Path(self.out)
        if self.resume:
            return path
        if self.overwrite and path.is_dir():
            for entry in path.iterdir():  # the check above: only the earlier run's outputs
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        path.mkdir(parents=True, exist_ok=True)
        self._mark(path)
        return path

    # -------------------------------------------------------------------------- pieces
    @staticmethod
    def _entries(path: Path) -> list[str]:
        """The names in ``path`` (folders with a trailing ``/``); ``[]`` when it is absent."""
        if not path.is_dir():
            return []
        try:
            return sorted(e.name + ("/" if e.is_dir() else "") for e in path.iterdir())
        except OSError as err:
            raise ValueError(f"--out {str(path)!r} cannot be listed: {err.strerror}") from None

    def _check_resumable(self, path: Path, names: list[str]) -> None:
        marker = path / RUN_MARKER
        if RUN_MARKER not in names:
            raise ValueError(
                f"--resume: --out {str(path)!r} holds no {self.recipe} run to continue"
                + ("" if path.is_dir() else " (it does not exist)")
            )
        try:
            recipe = json.loads(marker.read_text()).get("recipe")
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"--resume: {str(marker)!r} cannot be read: {err}") from None
        if recipe != self.recipe:
            raise ValueError(
                f"--resume: --out {str(path)!r} holds a {recipe} run, not a {self.recipe} run"
            )

    def _check_only_run_outputs(self, path: Path, names: list[str]) -> None:
        """Refuse ``--overwrite`` when ``path`` holds entries the earlier run did not write
        (by the ``outputs`` its marker records), listing them."""
        marker = path / RUN_MARKER
        try:
            doc = json.loads(marker.read_text())
            outputs = doc["outputs"]
            earlier = doc["recipe"]
            if not (isinstance(outputs, list) and all(isinstance(o, str) for o in outputs)):
                raise TypeError(f"'outputs' is {outputs!r}, not a list of patterns")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"--overwrite: {str(marker)!r} does not say which files the earlier run wrote "
                f"({type(err).__name__}: {err}), so nothing in --out {self.out!r} is removed: "
                "empty it yourself or choose another folder"
            ) from None
        foreign = foreign_entries(names, outputs)
        if foreign:
            shown = ", ".join(foreign[:_LISTED_FOREIGN])
            more = len(foreign) - _LISTED_FOREIGN
            raise ValueError(
                f"--overwrite: --out {self.out!r} holds {len(foreign)} entr"
                f"{'y' if len(foreign) == 1 else 'ies'} the earlier {earlier} run did not write: "
                f"{shown}{f' and {more} more' if more > 0 else ''}; --overwrite removes only a "
                "run's own files, so move these elsewhere (or choose another folder)"
            )

    def _mark(self, path: Path) -> None:
        created = datetime.now(UTC).isoformat(timespec="seconds")
        doc = {"recipe": self.recipe, "created": created, "outputs": [*self.outputs]}
        (path / RUN_MARKER).write_text(json.dumps(doc))

    def _fresh(self) -> Path:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        for n in itertools.count(1):
            path = Path("runs") / (f"{self.recipe}-{stamp}" + (f"-{n}" if n > 1 else ""))
            try:
                path.mkdir(parents=True)
            except FileExistsError:
                continue
            self._mark(path)
            return path
        raise AssertionError("unreachable")  # itertools.count never ends
