"""Command lines generated from a frozen dataclass of knobs: one idiom for every command of
the project (the recipes, ``python -m embark.plan``, ``python -m hps.updates`` ...).

A leaf: it imports only the standard library, so ``embark``, ``hps`` and ``recipes`` may all
import it. A command declares its knobs once, as a dataclass whose fields carry defaults and
help::

    @dataclass(frozen=True)
    class Knobs:
        steps: int = knob(3000, "optimizer steps", ge=1)
        lr: float = knob(0.03, "dense learning rate", gt=0)
        tables: tuple[int, ...] = knob((10, 20), "rows per table")
        out: str | None = knob(None, "output folder")
        progress: bool = knob(True, "show a progress bar")

        def __post_init__(self) -> None:
            check_knobs(self)

    cfg = parse_knobs(Knobs, description="what the command does")

:func:`parse_knobs` builds an ``argparse`` parser with one ``--flag`` per field (``--foo-bar``
for ``foo_bar``), the field's default and bounds shown in ``--help``, and returns the
dataclass instance; :func:`add_knobs` adds the same options to a parser of one's own (a
subcommand, positional arguments) and :func:`from_namespace` builds the instance from its
result. Supported field types: ``int``, ``float``, ``str``, ``bool`` (``--x`` / ``--no-x``),
a ``StrEnum`` or ``Literal[...]`` (choices), ``tuple[T, ...]`` (space-separated values) and
``T | None`` (the word ``none`` gives ``None``). :func:`check_knobs` enforces the bounds and
the field types, so a value out of range is a ``ValueError`` naming the flag, and on the
command line a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "Bounds",
    "add_knobs",
    "check_knobs",
    "flag",
    "from_namespace",
    "knob",
    "parse_knobs",
    "shown",
]

_SHOWN = 40  # characters of a bad value echoed back (a 5,000-digit number is not)


def shown(text: str) -> str:
    """``repr(text)``, shortened to about :data:`_SHOWN` characters with its length named."""
    if len(text) <= _SHOWN:
        return repr(text)
    return f"{text[:_SHOWN]!r}... ({len(text)} characters)"


T = TypeVar("T")


@dataclass(frozen=True)
class Bounds:
    """The range of a numeric knob: ``ge`` / ``gt`` below, ``le`` / ``lt`` above (``None``:
    open on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __contains__(self, v: float) -> bool:
        return (
            (self.ge is None or v >= self.ge)
            and (self.gt is None or v > self.gt)
            and (self.le is None or v <= self.le)
            and (self.lt is None or v < self.lt)
        )

    def text(self) -> str:
        """``">= 1"``, ``"> 0"``, ``"in [0, 1)"``, ``"in [1, 1048576]"`` (``""``: unbounded)."""
        lo: tuple[str, str, float] | None = None  # (bracket, comparison, bound)
        hi: tuple[str, str, float] | None = None
        if self.ge is not None:
            lo = ("[", ">=", self.ge)
        elif self.gt is not None:
            lo = ("(", ">", self.gt)
        if self.le is not None:
            hi = ("]", "<=", self.le)
        elif self.lt is not None:
            hi = (")", "<", self.lt)
        if lo and hi:
            return f"in {lo[0]}{_num(lo[2])}, {_num(hi[2])}{hi[0]}"
        one = lo or hi
        return f"{one[1]} {_num(one[2])}" if one else ""


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def knob(
    default: Any,
    help: str,  # noqa: A002 - argparse's own name for it
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    required: bool = False,
    option: str | None = None,
) -> Any:
    """A dataclass field with a default, its ``--help`` text and, for a number, its bounds
    (checked by :func:`check_knobs`, shown in ``--help``).

    ``parse`` replaces the converter the field's type implies with an ``argparse`` ``type``
    of one's own (its ``ArgumentTypeError`` is the usage error, naming the flag);
    ``choices`` lists the accepted words (names known only at run time, e.g. presets);
    ``required`` makes the flag mandatory on the command line (the default then serves
    only callers that build the dataclass in code; a required tuple takes one value or
    more); ``option`` names the flag where :func:`flag` of the field's name cannot (``--in``:
    ``in`` is a keyword).
    """
    if isinstance(default, list | dict | set):
        raise ValueError("knob defaults must be immutable; use a tuple instead of a list")
    meta: dict[str, Any] = {"help": help}
    if (ge, gt, le, lt) != (None, None, None, None):
        meta["bounds"] = Bounds(ge, gt, le, lt)
    if parse is not None:
        meta["parse"] = parse
    if choices is not None:
        meta["choices"] = tuple(choices)
    if required:
        meta["required"] = True
    if option is not None:
        meta["option"] = option
    return dataclasses.field(default=default, metadata=meta)


def flag(name: str) -> str:
    """The command-line flag of the knob ``name``: ``batch_size`` → ``--batch-size``."""
    return "--" + name.replace("_", "-")


def _scalar(tp: Any) -> tuple[Any, bool]:
    """``(T, optional)`` of a field type ``T`` or ``T | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def check_knobs(cfg: object) -> None:
    """Check every numeric knob of the dataclass instance ``cfg`` against its type (``int``:
    an integer, not a bool; ``float``: a finite number) and its declared bounds.

    Raises:
        ValueError: naming the flag, the expected range and the value:
            ``--batch-size must be an integer in [1, 1048576], got 1000000000``.
    """
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]  # cfg is a dataclass instance
        tp, optional = _scalar(hints[f.name])
        if tp not in (int, float):
            continue
        v = getattr(cfg, f.name)
        if v is None and optional:
            continue
        bounds: Bounds = f.metadata.get("bounds", Bounds())
        if tp is int:
            kind, ok = "an integer", isinstance(v, int) and not isinstance(v, bool)
        else:
            kind = "a finite number"
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if not (ok and v in bounds):
            want = " ".join(filter(None, (kind, bounds.text())))
            raise ValueError(f"{flag(f.name)} must be {want}, got {v!r}")


def _none_or(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _number(tp: type) -> Callable[[str], Any]:
    """``int`` or ``float`` as an argparse type whose error echoes a long value shortened
    (argparse's own repeats all 5,000 digits of one)."""

    def parse(text: str) -> Any:
        try:
            return tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid {tp.__name__} value: {shown(text)}"
            ) from None

    parse.__name__ = tp.__name__
    return parse


def _one_of(choices: Sequence[Any], name: str, optional: bool) -> Callable[[str], Any]:
    """A converter accepting exactly the choices' texts (an enum member's ``value``), and
    ``none`` (→ ``None``) when ``optional``.

    Choices are checked here rather than by argparse's ``choices=``: argparse compares the
    converted value, so it would reject ``None`` for an optional knob, and it lists choices
    by ``repr`` (``<OptimizerKind.SGD: 'sgd'>``) in its error.
    """
    by_text = {str(getattr(c, "value", c)): c for c in choices}
    allowed = ", ".join([*by_text, *(["none"] if optional else [])])

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        try:
            return by_text[text]
        except KeyError:
            # argparse's own wording for choices, listing values rather than reprs
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {allowed})"
            ) from None

    parse.__name__ = name
    return parse


def _converter(
    tp: Any, name: str, optional: bool = False
) -> tuple[Callable[[str], Any], list[str] | None]:
    """(string → value, the choices' texts or ``None``) for a scalar type; ``optional`` adds
    the word ``none`` for ``None``."""
    if typing.get_origin(tp) is typing.Literal:
        choices = list(typing.get_args(tp))
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        choices = list(tp)
    elif tp in (int, float, str):
        convert = _number(tp) if tp in (int, float) else tp
        return (_none_or(convert) if optional else convert), None
    else:
        raise TypeError(f"knob {name!r}: unsupported type {tp!r}")
    texts = [str(getattr(c, "value", c)) for c in choices]
    return _one_of(choices, name, optional), texts + (["none"] if optional else [])


def add_knobs(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per field of the dataclass ``cls`` to ``parser``.

    Raises:
        TypeError: for a field type the generator does not support, or a non-dataclass.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        optional = False
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                raise TypeError(f"knob {f.name!r}: unsupported union {tp!r}")
            tp, optional = args[0], True
            origin = typing.get_origin(tp)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"knob {f.name!r} needs a default")
        option = f.metadata.get("option", flag(f.name))
        help_text = f.metadata.get("help", "")
        value = default.value if isinstance(default, enum.Enum) else default
        if isinstance(value, tuple):
            value = " ".join(map(str, value))
        bounds = f.metadata.get("bounds")
        limits = f"; {bounds.text()}" if bounds is not None else ""
        kw: dict[str, Any] = {"dest": f.name, "default": default}
        if tp is bool:
            parser.add_argument(
                option,
                action=argparse.BooleanOptionalAction,
                help=f"{help_text} (default: {value})",
                **kw,
            )
            continue
        if origin is tuple:
            elem = typing.get_args(tp)[0]
            convert, choices = _converter(elem, f.name)
            kw["nargs"] = "*"
            kw["type"] = convert
        else:
            convert, choices = _converter(tp, f.name, optional)
            kw["type"] = convert
        if "parse" in f.metadata:
            kw["type"] = f.metadata["parse"]
        if "choices" in f.metadata:
            kw["choices"] = choices = list(f.metadata["choices"])
        if f.metadata.get("required", False):
            kw["required"] = True
            del kw["default"]
            if origin is tuple:
                kw["nargs"] = "+"
        if choices is not None:
            kw["metavar"] = "{" + ",".join(choices) + "}"
        shown_default = "required" if kw.get("required") else f"default: {value}"
        parser.add_argument(option, help=f"{help_text} ({shown_default}{limits})", **kw)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Build ``cls`` from parsed options (lists become tuples)."""
    values = {}
    # fields() is typed for dataclass instances and types alike; a bare TypeVar is neither
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # cls is a dataclass type
        v = getattr(ns, f.name)
        values[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**values)


def parse_knobs(
    cls: type[T],
    argv: Sequence[str] | None = None,
    description: str | None = None,
    check: Callable[[T], object] | None = None,
) -> T:
    """Parse ``argv`` (default ``sys.argv[1:]``) into an instance of the dataclass ``cls``.

    Errors raised by the dataclass's own validation (``ValueError`` in ``__post_init__``), or
    by ``check(instance)`` (``ValueError`` or ``OSError``: e.g. loading a file a knob names),
    are reported as argparse usage errors (exit code 2) naming the message.
    """
    parser = argparse.ArgumentParser(
        description=description or (cls.__doc__ or "").strip().split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_knobs(parser, cls)
    ns = parser.parse_args(argv)
    try:
        cfg = from_namespace(cls, ns)
        if check is not None:
            check(cfg)
        return cfg
    except (ValueError, OSError) as err:
        parser.error(str(err))
        raise  # parser.error exits; this line is for type checkers
