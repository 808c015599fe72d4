"""Every flag of every `shardline` command says what it does."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardline.cli.main import build_parser

SRC = Path(__file__).resolve().parent.parent / "src" / "shardline"


def _parsers(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


@pytest.mark.timeout(60)
def test_every_flag_of_every_command_has_help():
    missing = []
    seen = set()
    for path, parser in _parsers(build_parser(), "shardline"):
        seen.add(path)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{path}: {'/'.join(action.option_strings) or action.dest}")
    # The walk reaches the nested commands (a parser tree it did not walk would pass vacuously).
    assert {"shardline up", "shardline node", "shardline bench serve", "shardline models pull"} <= seen
    assert not missing, "flags without help:\n" + "\n".join(missing)


def _shardline_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("shardline")}


@pytest.mark.timeout(60)
def test_no_prefix_cache_reaches_the_instance_settings_of_every_command_that_takes_them():
    from shardline.cli.cluster import runner_settings
    from shardline.cli.local import engine_config, node_flags

    parse = build_parser().parse_args
    assert runner_settings(parse(["node"])).prefix_cache is True  # on unless asked
    off = runner_settings(parse(["node", "--no-prefix-cache", "--max-batch", "4"]))
    assert off.prefix_cache is False and off.max_batch == 4
    # Without the flag, --runner-settings may turn it off too; the flag never turns it back on.
    assert (
        runner_settings(parse(["node", "--runner-settings", '{"prefix_cache": false}'])).prefix_cache is False
    )
    # `up` passes it to every node it starts, as a flag the node takes.
    assert node_flags(parse(["up"])) == []
    up = node_flags(parse(["up", "--no-prefix-cache"]))
    assert runner_settings(parse(["node", *up])).prefix_cache is False
    # A local pipeline (`generate`) takes it as its engine's setting.
    model = Path("model")
    assert engine_config(parse(["generate", "hi"]), model).prefix_cache is True
    assert engine_config(parse(["generate", "--no-prefix-cache", "hi"]), model).prefix_cache is False
