"""A plain `pip install .` has everything shardline imports: every third-party module imported anywhere under
src/shardline (at module level or inside a function, as the bench commands do) belongs to a distribution the
runtime dependencies of pyproject.toml name, and every module imports."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

import pytest

import shardline

ROOT = Path(__file__).resolve().parent.parent
# Distributions whose import name differs from the name pyproject gives them (used where the installed
# environment does not say: packages_distributions() knows only what is installed).
IMPORT_NAMES = {
    "eclipse-zenoh": {"zenoh"},
    "pyyaml": {"yaml"},
    "mlx-lm": {"mlx_lm"},
    "prometheus-client": {"prometheus_client"},
    "pillow": {"PIL"},
    "scikit-learn": {"sklearn"},
    "pydantic-ai-slim": {"pydantic_ai"},
}
# Extras that one bench needs and names when they are absent (the pip command): imports of theirs are
# covered in that bench's module only.
BENCH_EXTRAS = {"bench-clients": "bench/extract.py"}


def _normal(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _names(deps: list[str]) -> set[str]:
    # "mlx[cpu]>=0.32; sys_platform == 'linux'" -> "mlx"
    return {_normal(re.match(r"[A-Za-z0-9_.-]+", dep).group(0)) for dep in deps}


def runtime_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return _names(project["dependencies"])


def extra_distributions(extra: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return _names(project["optional-dependencies"][extra])


def covered_imports(dists: set[str]) -> set[str]:
    names = set()
    for dist in dists:
        names |= IMPORT_NAMES.get(dist, {dist.replace("-", "_")})
    for name, owners in importlib.metadata.packages_distributions().items():
        if any(_normal(o) in dists for o in owners):
            names.add(name)
    return names


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> the shardline files importing it."""
    found: dict[str, set[str]] = {}
    src = Path(shardline.__file__).parent
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top != "shardline" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(src)))
    return found


@pytest.mark.timeout(120)
def test_every_module_imports():
    failed = []
    for info in pkgutil.walk_packages(shardline.__path__, "shardline."):
        if info.name.endswith(".__main__"):
            continue  # importing it runs the command line
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # a module that cannot import is what this test is for
            failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)


@pytest.mark.timeout(60)
def test_every_third_party_import_is_a_runtime_dependency():
    dists = runtime_distributions()
    assert {"httpx", "eclipse-zenoh", "fastapi"} <= dists
    covered = covered_imports(dists)
    imports = third_party_imports()
    assert "httpx" in imports and "zenoh" in imports  # the scan sees function-level and renamed imports
    for extra, module in BENCH_EXTRAS.items():
        for name in covered_imports(extra_distributions(extra)):
            if name not in covered and name in imports:
                imports[name].discard(module)
    missing = {name: sorted(files) for name, files in imports.items() if name not in covered and files}
    assert not missing, f"imported but not a runtime dependency in pyproject.toml: {missing}"


@pytest.mark.timeout(60)
def test_test_only_packages_are_not_runtime_dependencies():
    # The other way round: what only tests use stays out of a plain install.
    dists = runtime_distributions()
    # openai is not among them: `shardline bench soak` drives the API with the official client.
    assert not dists & {"pytest", "anthropic", "ollama", "schemathesis", "playwright"}
