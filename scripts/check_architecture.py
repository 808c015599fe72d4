#!/usr/bin/env python3
"""The house plan's rules, checked from the source alone (`make lint` and tests/test_ci_guards.py run it):

- no import cycle between packages (src/shardline/<package>/; a top-level module is its own package), so the
  folders layer as docs/architecture.md draws them;
- no class name defined twice in src/, so a name means one thing;
- no module over 500 lines unless its docstring has a line starting "Over 500 lines:" that says why.

Prints one line per breach and exits 1, or exits 0 silently.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "shardline"
MAX_LINES = 500


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path, root: Path, tree: ast.AST) -> set[str]:
    """Every shardline module this file imports, anywhere in it (imports inside functions count too)."""
    module = _module(path, root)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
    return {m for m in found if m == "shardline" or m.startswith("shardline.")}


def package_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def breaches(root: Path = ROOT) -> list[str]:
    edges: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], str] = {}
    classes: dict[str, list[str]] = defaultdict(list)
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        rel = path.relative_to(root.parent)
        pkg = _package(_module(path, root))
        for target in _imports(path, root, tree):
            other = _package(target)
            if other not in (pkg, "shardline"):
                edges[pkg].add(other)
                why.setdefault((pkg, other), f"{rel} imports {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name].append(f"{rel}:{node.lineno}")
        lines = text.count("\n")
        doc = ast.get_docstring(tree) or ""
        if lines > MAX_LINES and not any(s.startswith("Over 500 lines:") for s in doc.splitlines()):
            out.append(f"{rel}: {lines} lines and no 'Over 500 lines:' reason in its docstring")
    for cycle in package_cycles(edges):
        links = [why[(a, b)] for a in cycle for b in cycle if (a, b) in why]
        out.append(f"import cycle between packages {', '.join(cycle)}: " + "; ".join(links))
    for name, places in sorted(classes.items()):
        if len(places) > 1:
            out.append(f"class {name} is defined {len(places)} times: {', '.join(places)}")
    return out


def main() -> int:
    found = breaches()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
