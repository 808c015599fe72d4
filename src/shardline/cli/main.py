"""The `shardline` command: its parser, built from each command family's module, and the dispatch.

cli/local.py     generate (a local pipeline, or --cluster), up (a local cluster of node daemons)
cli/cluster.py   node (this machine's daemon), cluster init|add-node|revoke|forget, place
cli/models.py    models pull|list|synth
cli/run.py       run (chat with a model, or answer one prompt; cli/chat_terminal.py)
cli/bench.py     bench engine|arch|tp|attention|chaos|resume|cluster|serve|quality|scale|llama-cpp|soak
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from shardline.cli import bench, cluster, local, models, run
from shardline.cli.common import CliError

DESCRIPTION = "The `shardline` command."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True)
    # In the order `shardline --help` lists them.
    run.add_run(sub)
    local.add_generate(sub)
    cluster.add_node(sub)
    local.add_up(sub)
    cluster.add_cluster(sub)
    cluster.add_place(sub)
    models.add_commands(sub)
    bench.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    from pydantic import ValidationError

    from shardline.errors import EngineError, OverloadError, RequestError
    from shardline.models.errors import ModelError

    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nshardline: interrupted", file=sys.stderr)
        return 130
    except (
        CliError,
        ModelError,
        EngineError,
        OverloadError,
        RequestError,
        ValueError,
        ValidationError,
        OSError,
    ) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"shardline: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
