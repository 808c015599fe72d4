#!/usr/bin/env bash
# OpenBLAS makes MLX's CPU matmul ~10-20x faster on Linux (its wheel bundles a reference BLAS).
# Optional: shardline runs without it, just slower.
set -u
[ "$(uname -s)" = Linux ] || exit 0
ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' && exit 0
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing OpenBLAS (libopenblas0-pthread) for fast CPU matmul"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null \
    || echo "warning: could not install OpenBLAS; CPU inference will be slow" >&2
else
  echo "hint: install OpenBLAS (e.g. 'apt-get install libopenblas0-pthread') for ~10x faster CPU inference" >&2
fi
exit 0
