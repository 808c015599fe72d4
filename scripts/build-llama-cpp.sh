#!/bin/sh
# Build llama.cpp's llama-bench, llama-perplexity and llama-tokenize (CPU only, native instructions, Release)
# from the llama.cpp vendored in the llama-cpp-python sdist, into the user's cache; the benches and the
# tokenizer tests compare against them.
# Takes about 10 minutes on 2 cores. Usage: scripts/build-llama-cpp.sh [JOBS]
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m shardline bench llama-cpp --build ${1:+--jobs "$1"}
