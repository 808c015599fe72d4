#!/usr/bin/env bash
# The dashboard's tests drive the system's Chromium through Playwright (which must never download one).
# Only the tests need it: `make test` calls this, `make run` does not.
set -u
command -v chromium >/dev/null 2>&1 && exit 0
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing chromium (Debian's package) for the dashboard's browser tests"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    || echo "warning: could not install chromium; the dashboard's tests will fail" >&2
else
  echo "hint: install Chromium (e.g. 'apt-get install chromium') for the dashboard's tests" >&2
fi
exit 0
