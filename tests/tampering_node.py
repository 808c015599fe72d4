"""A `shardline node` whose weight server alters the bytes of one model's tensors as it sends them: a lying
source, for tests of the fetcher's checks. Nothing else differs (its files, its manifest and the digest it
reports are honest), so only the check of every byte against the expected digest can catch it.

    python tests/tampering_node.py MODEL <shardline arguments: -v node ...>

Test-only by construction: the fault is a Python argument (`Node(..., weight_tamper=...)`); no flag,
environment variable or message of the shipped command line reaches it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shardline.cluster.weights.server import Tamper


def flip_first_byte(model: str) -> Tamper:
    """A Tamper (cluster/weights/server.py) that flips the first byte of every tensor chunk of `model`."""

    def tamper(served: str, kind: str, name: str, offset: int, data: bytes) -> bytes:
        if served != model or kind != "tensor" or not data:
            return data
        return bytes([data[0] ^ 0xFF]) + data[1:]

    return tamper


def main(argv: Sequence[str]) -> int:
    model, rest = argv[0], list(argv[1:])
    from shardline.cli.main import main as cli_main
    from shardline.node import daemon as node

    honest = node.Node

    class TamperingNode(honest):  # type: ignore[misc, valid-type]
        def __init__(self, config: node.NodeConfig) -> None:
            super().__init__(config, weight_tamper=flip_first_byte(model))

    node.Node = TamperingNode  # type: ignore[misc]  # `shardline node` looks the class up when it runs
    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
