"""Recipes compose the packages through their roots: no recipe imports a deep module of
``embark``, ``tilesparse``, ``hps``, ``export``, ``cutlass_kernels`` or ``knobs`` (DESIGN: each package
root exports its public names)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PACKAGES = frozenset({"embark", "tilesparse", "hps", "export", "cutlass_kernels", "knobs"})
# hps/serving is its own room (the v2 server, with starlette and grpc): importing the
# parameter server's root does not pay for it, so it keeps its own root.
SUBPACKAGE_ROOTS = frozenset({"hps.serving"})


def deep_imports(source: str, filename: str) -> list[str]:
    """``"<line>: <module>"`` for each import of a non-root module of our packages."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top in PACKAGES and module != top and module not in SUBPACKAGE_ROOTS:
                found.append(f"{node.lineno}: {module}")
    return found


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.py")), ids=lambda p: p.name)
def test_recipe_imports_only_package_roots(path: Path) -> None:
    assert deep_imports(path.read_text(), str(path)) == []


def test_check_finds_deep_imports() -> None:
    source = (
        "import tilesparse\n"
        "from embark import Trainer\n"
        "from hps.serving import InferenceServer\n"
        "from embark.training.trainer import Trainer\n"
        "import export.artifacts\n"
        "def f():\n"
        "    from tilesparse.schedule import end_step\n"
    )
    assert deep_imports(source, "x.py") == [
        "4: embark.training.trainer",
        "5: export.artifacts",
        "7: tilesparse.schedule",
    ]
