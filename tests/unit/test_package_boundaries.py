"""Service packages share only services/ (the shared kernel) and the protos: none imports
another service's package, and the shared kernel imports no service."""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("fingerprint_svc", "estimator_svc", "deploy_svc", "scheduler_svc", "monitor_agent")


def _imported_packages(package: str) -> dict[str, set[str]]:
    """Top-level packages each module of ``package`` imports, by module path."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize("package", SERVICES)
def test_a_service_imports_no_other_service(package):
    others = set(SERVICES) - {package}
    crossing = {
        module: sorted(names & others)
        for module, names in _imported_packages(package).items()
        if names & others
    }
    assert crossing == {}


def test_the_shared_kernel_imports_no_service():
    # The CLI starts the services by module name (python -m ...), not by importing them.
    crossing = {
        module: sorted(names & set(SERVICES))
        for module, names in _imported_packages("services").items()
        if names & set(SERVICES)
    }
    assert crossing == {}


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant in ``path`` that is not a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    ]


def test_every_environment_variable_is_named_only_in_services_settings():
    # iserve up (services/cli/stack.py) writes variables for the processes it starts.
    allowed = {ROOT / "services" / "settings.py", ROOT / "services" / "cli" / "stack.py"}
    variable = re.compile(r"ISERVE_\w+|REDIS_URL")
    named = {
        f"{path.relative_to(ROOT)}:{line}": value
        for package in ("services", *SERVICES)
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in allowed and "api" not in path.relative_to(ROOT).parts
        for line, value in _code_strings(path)
        if variable.fullmatch(value)
    }
    assert named == {}


def _module_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports (lazy imports too)."""
    files = {}
    for package in ("services", *SERVICES):
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if "api" not in relative.parts:
                name = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
                files[name] = path

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(0, node.level - 1)):
                    base = base.rpartition(".")[0]
                module = (
                    node.module if not node.level else ".".join(filter(None, [base, node.module]))
                )
                imported.add(module)
                imported.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {target for t in imported if (target := resolve(t)) not in (None, name)}
    return graph


def test_no_module_imports_itself_through_others():
    graphlib.TopologicalSorter(_module_graph()).prepare()  # CycleError names the circle
