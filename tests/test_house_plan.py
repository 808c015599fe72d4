"""The house plan holds (scripts/check_architecture.py, also run by `make lint`), and its checker catches what
it is there to catch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_architecture.py"
_spec = importlib.util.spec_from_file_location("check_architecture", SCRIPT)
assert _spec and _spec.loader
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


@pytest.mark.timeout(60)
def test_the_source_tree_keeps_the_house_plan():
    assert check.breaches() == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "shardline"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


@pytest.mark.timeout(10)
def test_a_cycle_between_packages_is_named_with_the_imports_that_make_it(tmp_path):
    pkg = _tree(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/x.py": "from shardline.b.y import f\n",
            "b/__init__.py": "",
            "b/y.py": "def f():\n    from shardline.a import x\n",  # inside a function counts too
            "c/z.py": "from shardline.a.x import f\n",  # one way only: no cycle
        },
    )
    found = check.breaches(pkg)
    assert len(found) == 1
    assert "import cycle between packages a, b" in found[0]
    assert "shardline/a/x.py imports shardline.b.y" in found[0]


@pytest.mark.timeout(10)
def test_a_class_name_defined_twice_and_a_long_module_without_its_reason_are_named(tmp_path):
    long_body = "x = 1\n" * 501
    pkg = _tree(
        tmp_path,
        {
            "a/one.py": "class Tick:\n    pass\n",
            "b/two.py": "class Tick:\n    pass\n",
            "a/long.py": '"""A long module."""\n' + long_body,
            "a/long_ok.py": '"""A long module.\n\nOver 500 lines: one table.\n"""\n' + long_body,
        },
    )
    found = check.breaches(pkg)
    assert any(f.startswith("class Tick is defined 2 times") for f in found)
    assert any("shardline/a/long.py: 502 lines" in f for f in found)
    assert not any("long_ok" in f for f in found)
