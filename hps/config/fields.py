"""Typed reads of the fields of a decoded JSON object (``ps.json``), each error naming the
field as ``<where>.<key>[<i>]`` (``models[0].embedding_vecsize_per_table[1]``).

A JSON integer is accepted where a number is expected (and becomes a ``float``); a boolean is
never an integer; ``NaN`` and ``Infinity`` (which ``json.loads`` takes) are refused. As in
HugeCTR's configs (its CI template wrote ``"max_batch_size": "1"``, ``"gpucache": "true"``,
``"deployed_device_list": ["0"]``), a number or a boolean may be written as a JSON string:
``"64"`` is read as the integer 64, ``"0.5"`` as a number, ``"true"`` / ``"false"`` as booleans.

Errors are collected in a :class:`Problems` so that a document reports all of them at once
(:class:`ConfigError`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "MISSING",
    "ConfigError",
    "Problems",
    "check",
    "enum_field",
    "field",
    "list_field",
    "no_unknown",
    "object_field",
    "resolve_path",
]

MISSING: Any = object()  # the default of a required field
E = TypeVar("E", bound=StrEnum)
T = TypeVar("T")

_INT_TEXT = re.compile(r"[+-]?[0-9]{1,30}")
_FLOAT_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?")
_BOOL_TEXT = {"true": True, "false": False}


def _from_text(v: Any, typ: type) -> Any:
    """A number or boolean written as a JSON string (``"64"``, ``"0.5"``, ``"true"``) as that
    value when ``typ`` asks for one; anything else unchanged."""
    if not isinstance(v, str):
        return v
    if typ is bool:
        return _BOOL_TEXT.get(v, v)
    if typ is int and _INT_TEXT.fullmatch(v):
        return int(v)
    if typ is float and _FLOAT_TEXT.fullmatch(v):
        return float(v)
    return v


_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
}


def _is(v: Any, typ: type) -> bool:
    """``isinstance`` as JSON means it: a boolean is not a number, an integer is a number."""
    if typ is bool:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    return isinstance(v, typ) or (typ is float and isinstance(v, int))


def _finite(v: float) -> float | None:
    """``v`` as a finite ``float``; ``None`` for NaN, an infinity, or an integer too large for
    a float (``float(10**400)`` raises ``OverflowError``)."""
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def field(d: dict[str, Any], key: str, where: str, typ: type, default: Any = MISSING) -> Any:
    """``d[key]`` checked to be of ``typ`` (``default`` when absent; required when
    ``default`` is :data:`MISSING`).

    Raises:
        ValueError: a required field is missing, or the value has another type or is not finite.
    """
    if key not in d:
        if default is MISSING:
            raise ValueError(f"{where}.{key}: required field is missing")
        return default
    v = _from_text(d[key], typ)
    if not _is(v, typ):
        raise ValueError(
            f"{where}.{key}: expected {_TYPE_NAMES[typ]}, got {v!r} ({type(v).__name__})"
        )
    if typ is float:
        v = _finite(v)
        if v is None:
            raise ValueError(
                f"{where}.{key}: {d[key]!r:.40} is impossible; expected a finite number"
            )
    return v


class ConfigError(ValueError):
    """Every error found in one ``ps.json``, each naming its field, the value and what was
    expected (``errors``); the message lists them all, one a line."""

    def __init__(self, name: str, errors: list[str]) -> None:
        self.name, self.errors = name, tuple(errors)
        if len(errors) == 1:
            super().__init__(errors[0])
        else:
            lines = "\n".join(f"  {e}" for e in errors)
            super().__init__(f"{name}: {len(errors)} errors:\n{lines}")


class Problems:
    """The errors of one document, collected so that all are reported at once.

    Each read goes through :meth:`read`: a ``ValueError`` it raises is recorded and the
    ``fallback`` returned, so parsing goes on to the next field.
    """

    def __init__(self) -> None:
        self.errors: list[str] = []

    def read(self, fn: Callable[..., T], *args: Any, fallback: T, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, or ``fallback`` once its ``ValueError`` is recorded."""
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            self.errors.append(str(e))
            return fallback

    def check(self, ok: bool, where: str, key: str, value: Any, expected: str) -> bool:
        """Record the error :func:`check` would raise; returns ``ok``."""
        if not ok:
            self.errors.append(f"{where}.{key}: {value!r} is impossible; expected {expected}")
        return ok

    def add(self, message: str) -> None:
        self.errors.append(message)

    def raise_any(self, name: str) -> None:
        """Raise :class:`ConfigError` (all errors of ``name``) if any was recorded."""
        if self.errors:
            raise ConfigError(name, self.errors)


def check(ok: bool, where: str, key: str, value: Any, expected: str) -> None:
    """Raise ``ValueError`` naming ``<where>.<key>``, ``value`` and what was ``expected``
    unless ``ok``."""
    if not ok:
        raise ValueError(f"{where}.{key}: {value!r} is impossible; expected {expected}")


def enum_field(
    d: dict[str, Any],
    key: str,
    where: str,
    enum: type[E],
    default: E,
    aliases: Mapping[str, str] | None = None,
) -> E:
    """``d[key]`` as a member of ``enum`` (``default`` when absent); a key of ``aliases`` (the
    other spellings HugeCTR takes, :mod:`hps.config.hugectr`) means the member its value names.

    Raises:
        ValueError: a value that is neither one of the enum's nor an alias, naming them.
    """
    v = field(d, key, where, str, default.value)
    aliases = aliases or {}
    try:
        return enum(aliases.get(v, v))
    except ValueError:
        names = [e.value for e in enum] + [a for a in aliases if aliases[a] in set(enum)]
        raise ValueError(f"{where}.{key}: {v!r} is not one of {names}") from None


def no_unknown(d: dict[str, Any], allowed: set[str], where: str) -> None:
    """Raise ``ValueError`` naming the fields of ``d`` that are not ``allowed``."""
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def object_field(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """``d[key]`` checked to be an object (``{}`` when absent)."""
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ValueError(f"{where}.{key}: expected an object, got {type(v).__name__}")
    return v


def list_field(
    d: dict[str, Any],
    key: str,
    where: str,
    item: type,
    n: int | None,
    default: Any = MISSING,
    ok: Callable[[Any], bool] | None = None,
    expected: str = "",
) -> list[Any]:
    """``d[key]``, a list of ``n`` (any number when ``None``) items of type ``item``, each
    passing ``ok`` (described by ``expected`` in the error).

    Raises:
        ValueError: naming the field and the first bad item's index.
    """
    v = field(d, key, where, list, default)
    if n is not None and len(v) != n:
        raise ValueError(f"{where}.{key}: expected {n} entries (one per table), got {len(v)}")
    out = []
    for i, x in enumerate(v):
        x = _from_text(x, item)
        if not _is(x, item):
            raise ValueError(f"{where}.{key}[{i}]: expected {_TYPE_NAMES[item]}, got {x!r}")
        if item is float:
            f = _finite(x)
            if f is None:
                raise ValueError(
                    f"{where}.{key}[{i}]: {x!r:.40} is impossible; expected a finite number"
                )
            x = f
        if ok is not None and not ok(x):
            raise ValueError(f"{where}.{key}[{i}]: {x!r} is impossible; expected {expected}")
        out.append(x)
    return out


def resolve_path(p: str, base: Path | None, where: str) -> str:
    """``p`` (the field ``where``) resolved against ``base`` (the folder of ``ps.json``) when
    it is relative.

    Raises:
        ValueError: naming ``where`` for a path holding a NUL character (no file system
            takes one).
    """
    if "\0" in p:
        raise ValueError(f"{where}: {p!r} is impossible; expected a path (it holds a NUL)")
    if not p or base is None or Path(p).is_absolute():
        return p
    return str(base / p)
