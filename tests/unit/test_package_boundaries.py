"""Service packages share only services/ (the shared kernel) and the protos: none imports
another service's package, and the shared kernel imports no service."""

from __future__ import annotations

import ast
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
