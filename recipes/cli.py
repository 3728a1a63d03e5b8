"""Command lines generated from a recipe's dataclass of knobs.

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
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def knob(default: Any, help: str) -> Any:  # noqa: A002 - argparse's own name for it
    """A dataclass field with a default and its ``--help`` text (tuples/lists are copied)."""
    if isinstance(default, list | dict | set):
        raise ValueError("knob defaults must be immutable; use a tuple instead of a list")
    return dataclasses.field(default=default, metadata={"help": help})


def _none_or(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
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
        return (_none_or(tp) if optional else tp), None
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
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        shown = default.value if isinstance(default, enum.Enum) else default
        if isinstance(shown, tuple):
            shown = " ".join(map(str, shown))
        kw: dict[str, Any] = {"dest": f.name, "default": default}
        if tp is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                help=f"{help_text} (default: {shown})",
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
        if choices is not None:
            kw["metavar"] = "{" + ",".join(choices) + "}"
        parser.add_argument(flag, help=f"{help_text} (default: {shown})", **kw)


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
