"""The import direction of ``rl_engine`` (docs/design/architecture.md), enforced.

The layers are an import-linter contract in ``pyproject.toml``; grimp reads every import
statement, including those inside functions. Loads by name (``importlib``) are invisible to it,
so an AST scan keeps them on an explicit allow-list. Each check has a negative control: an
upward import injected into a copy of the package breaks the contract, and an unlisted
``importlib`` load is reported.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rl_engine"

#: Loads by name of rl_engine modules that the layering allows: (file, what it may load). The package root and
#: ``rl_engine.ops`` load their own sub-packages lazily; the registry loads the implementation
#: packages (backends, reference) of an operator family when it is first dispatched — an
#: implementation registers itself, so dispatch reaches up by name and never by import; the vLLM
#: plugin loads vLLM's own layer classes.
ALLOWED_LOADS = {
    "rl_engine/__init__.py": ("rl_engine.",),
    "rl_engine/ops/__init__.py": ("rl_engine.ops.",),
    "rl_engine/runtime/registry.py": ("rl_engine.backends.", "rl_engine.reference"),
    "rl_engine/integrations/vllm/plugin.py": ("vllm.",),
}

_LOADERS = {"import_module", "find_spec", "__import__"}


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}, timeout=300)


def name_loads(path: Path, rel: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every load by name in ``path`` (``target`` is the string literal or
    f-string prefix passed, ``"?"`` when the name is computed)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name not in _LOADERS or not node.args:
            continue
        a = node.args[0]
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            target = a.value
        elif isinstance(a, ast.JoinedStr) and a.values and isinstance(a.values[0], ast.Constant):
            target = a.values[0].value
        elif isinstance(a, ast.JoinedStr) and a.values and isinstance(a.values[0], ast.FormattedValue) \
                and isinstance(a.values[0].value, ast.Name) and a.values[0].value.id == "__name__":
            target = rel.removesuffix("/__init__.py").removesuffix(".py").replace("/", ".") + "."
        else:
            target = "?"
        out.append((node.lineno, target))
    return out


def unlisted_loads(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        allowed = ALLOWED_LOADS.get(rel, ())
        for line, target in name_loads(path, rel):
            if target != "?" and not target.startswith("rl_engine"):
                continue  # another distribution (triton, vllm): no edge inside the package
            if target == "?" and rel in ALLOWED_LOADS:
                continue  # a computed name inside an allow-listed loader (checked below by value)
            if not target.startswith(allowed) or not allowed:
                bad.append(f"{rel}:{line}: loads {target!r} by name")
    return bad


def test_layers_contract_holds():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 kept, 0 broken" in res.stdout


def test_layers_contract_fails_on_an_upward_import(tmp_path):
    # negative control: a function-level import from ops up into validation, in a copy
    shutil.copytree(PKG, tmp_path / "rl_engine", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    gemm = tmp_path / "rl_engine" / "ops" / "gemm" / "__init__.py"
    gemm.write_text(gemm.read_text() + "\n\ndef _upward():\n    from rl_engine.validation import capture  # noqa: F401\n")
    res = _lint(tmp_path)
    assert res.returncode != 0
    assert "rl_engine.ops.gemm -> rl_engine.validation.capture" in res.stdout


def test_loads_by_name_are_on_the_allow_list():
    assert unlisted_loads(PKG) == []
    # the registry's computed names are exactly the implementation packages
    from rl_engine.runtime import registry

    assert all(p.startswith("rl_engine.backends.") for p in registry._ALL_PACKAGES)


def test_unlisted_load_by_name_is_reported(tmp_path):
    # negative control: an importlib load of validation from ops
    pkg = tmp_path / "rl_engine"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "ops" / "sneaky.py").write_text(
        "import importlib\n\ndef f():\n    return importlib.import_module('rl_engine.validation.capture')\n")
    assert unlisted_loads(pkg) == ["rl_engine/ops/sneaky.py:4: loads 'rl_engine.validation.capture' by name"]


def imports_of_tests(roots: list[Path]) -> list[str]:
    """``file:line`` of every import of the ``tests`` tree (any depth, inside functions too) in
    the ``.py`` files under ``roots``: the package, its tools and its benchmarks stand without it."""
    bad = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                if any(n == "tests" or n.startswith("tests.") for n in names):
                    bad.append(f"{rel}:{node.lineno}")
    return bad


def test_package_tools_and_benchmarks_do_not_import_tests():
    assert imports_of_tests([PKG, ROOT / "tools", ROOT / "benchmarks"]) == []


def test_import_of_tests_is_reported(tmp_path):
    # negative control: a tool that borrows a test helper, at module level and inside a function
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "probe.py").write_text("from tests.helpers import qwen3  # noqa\n\ndef f():\n    import tests.conftest\n")
    assert imports_of_tests([tools]) == ["tools/probe.py:1", "tools/probe.py:4"]
