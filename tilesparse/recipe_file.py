"""Reading a pruning recipe file (``.yaml``/``.yml`` or ``.json``) into the mapping that
:meth:`tilesparse.config.TileSparseConfig.from_dict` builds a config from.

A key given twice in one mapping is refused, in YAML and in JSON alike: both parsers would
keep the last value silently, so a recipe could prune other than it reads. Every error is one
``ValueError`` line naming the file (and, where known, the line and column)::

    recipe file r.yaml: key 'sparsity' at line 3 (first at line 2) is given twice in one
    mapping; only one value can hold, so each key must be unique
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RECIPE_SUFFIXES", "read_recipe"]

# The suffixes a recipe file may have; YAML for both YAML spellings, else JSON.
RECIPE_SUFFIXES = (".yaml", ".yml", ".json")


def read_recipe(p: Path) -> Any:
    """The parsed content of recipe file ``p`` (``None`` for an empty YAML file).

    Raises:
        ValueError: one line naming the file, for a suffix not in :data:`RECIPE_SUFFIXES`,
            text that is not UTF-8 or does not parse (with its line and column), or a key
            given twice in one mapping (naming it and the lines of both).
        OSError: when the file cannot be read.
    """
    suffix = p.suffix.lower()
    if suffix not in RECIPE_SUFFIXES:
        raise ValueError(f"recipe file {p}: expected a .yaml, .yml or .json suffix, got {suffix!r}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"recipe file {p}: not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    return _parse_yaml(p, text) if suffix != ".json" else _parse_json(p, text)


class _DuplicateKey(ValueError):
    """A mapping gives a key twice (``key``)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _duplicate_message(p: Path, key: str, line: int | None, first: int | None) -> str:
    where = f" at line {line} (first at line {first})" if line is not None else ""
    return (
        f"recipe file {p}: key {key!r}{where} is given twice in one mapping; only one value "
        "can hold, so each key must be unique"
    )


def _first_duplicate(node: Any) -> tuple[str, int, int] | None:
    """The first key a YAML node tree gives twice in one mapping: ``(key, its line, the line
    of its first occurrence)`` (1-based), or ``None``. Merge keys (``<<``) are not counted."""
    import yaml

    todo, visited = [node], set()
    while todo:
        n = todo.pop()
        if id(n) in visited:  # an alias: the same node again
            continue
        visited.add(id(n))
        if isinstance(n, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    line = k.start_mark.line + 1
                    if (k.tag, k.value) in seen:
                        return k.value, line, seen[(k.tag, k.value)]
                    seen[(k.tag, k.value)] = line
                todo.append(v)
        elif isinstance(n, yaml.SequenceNode):
            todo.extend(n.value)
    return None


def _parse_json(p: Path, text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"recipe file {p}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    except _DuplicateKey as e:  # the lines: from the text read as YAML (JSON's superset here)
        import yaml

        try:
            found = _first_duplicate(yaml.compose(text, Loader=yaml.SafeLoader))
        except yaml.YAMLError:
            found = None
        line, first = (found[1], found[2]) if found and found[0] == e.key else (None, None)
        raise ValueError(_duplicate_message(p, e.key, line, first)) from None


def _parse_yaml(p: Path, text: str) -> Any:
    import yaml

    try:
        found = _first_duplicate(yaml.compose(text, Loader=yaml.SafeLoader))
        if found is not None:
            raise ValueError(_duplicate_message(p, *found))
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"recipe file {p}: not valid YAML: {what}{where}") from None
