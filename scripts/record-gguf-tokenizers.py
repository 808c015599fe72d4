#!/usr/bin/env python3
"""Record llama.cpp's tokenization of the test strings into tests/data/tokenizers/<family>.json.

tests/test_gguf_tokenizers.py compares our GGUF tokenizers to these ids, so the tests never need
llama.cpp; this script is how they were made. It needs `llama-tokenize`
(`shardline bench llama-cpp --build`). The vocabulary GGUFs beside the ids are trained once
(`--retrain` trains and writes them again: the ids must then be recorded again too).

Usage: .venv/bin/python scripts/record-gguf-tokenizers.py [--retrain] [FAMILY ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from shardline.bench.llama_cpp import binary, missing_message
from shardline.testing import tokenizer_fixtures as fx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true", help="train and write the vocabulary GGUFs again")
    parser.add_argument("families", nargs="*", help="only these (default: all)")
    args = parser.parse_args()
    exe = binary("llama-tokenize")
    if exe is None:
        print(missing_message(), file=sys.stderr)
        return 1
    if args.retrain or not all((fx.DATA_DIR / f.vocab).exists() for f in fx.FAMILIES):
        fx.make_vocabularies(fx.DATA_DIR)
    chosen = tuple(f for f in fx.FAMILIES if not args.families or f.name in args.families)
    with tempfile.TemporaryDirectory() as tmp:
        for path in fx.record(exe, Path(tmp), chosen):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
