"""The import layers of pyproject.toml's [tool.importlinter] hold, and a violation of them is caught.

``nox -s lint`` runs the same contracts; here they run in the default suite too, against the source
tree (core/ first on the path, so an installed copy of trellis is never the one checked).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"


def lint_imports(source_root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contracts, on the ``trellis`` package under ``source_root``."""
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache", str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(source_root)},
    )  # fmt: skip


def test_the_contracts_are_kept():
    proc = lint_imports(CORE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 1 kept, 0 broken." in proc.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """A trainer module importing a recipe (even inside a function) is reported with its line."""
    shutil.copytree(CORE / "trellis", tmp_path / "trellis", ignore=shutil.ignore_patterns("__pycache__"))
    metrics = tmp_path / "trellis" / "trainer" / "metrics.py"
    metrics.write_text(metrics.read_text() + "\n\ndef _up():\n    import trellis.recipes.presets\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 kept, 1 broken" in proc.stdout
    assert "trellis.trainer.metrics -> trellis.recipes.presets" in proc.stdout


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (functions and branches included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_trainer_imports_neither_recipes_nor_testing():
    """The trainer sits below the recipes and the conformance kit: importing them would close a cycle."""
    files = sorted((CORE / "trellis" / "trainer").rglob("*.py"))
    assert files
    upward = {
        f"{path.relative_to(CORE)}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name.split(".")[:2] in (["trellis", "recipes"], ["trellis", "testing"])
    }
    assert not upward, sorted(upward)


def test_importing_the_trainer_loads_no_recipe_or_testing_module(python):
    modules = sorted(p.stem for p in (CORE / "trellis" / "trainer").glob("*.py") if p.stem != "__init__")
    proc = python(
        "import sys, importlib\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('trellis.trainer.' + name)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('trellis.recipes', 'trellis.testing'))))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(path: Path) -> set[str]:
    """Imports in ``path`` of a private module, or of a private name of another module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            names = [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            modules, names = [a.name for a in node.names], []
        else:
            continue
        modules = [m for m in modules if any(_private(part) for part in m.split(".")[1:])]
        found.update(name for name in modules + names if name.startswith("trellis."))
    return found


def test_no_module_imports_a_private_name_of_another():
    """Private means private to its module: what another module needs gets a public name in its layer."""
    allowed = {"trellis/__init__.py: trellis._version"}  # the package's own version module
    found = {
        f"{path.relative_to(CORE)}: {name}"
        for path in sorted((CORE / "trellis").rglob("*.py"))
        for name in _private_imports(path)
    }
    unexpected = found - allowed
    assert not unexpected, sorted(unexpected)
