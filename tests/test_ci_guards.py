"""What keeps CI honest: the tests that need root run there, never skip."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from shardline.testing import netns
from shardline.testing.namespaces import NetnsError
from shardline.testing.netns import REQUIRE_ROOT_TESTS, NetLab, netns_skip_reason

CI_RUN = Path(__file__).resolve().parents[1] / ".ci" / "run"


@pytest.mark.timeout(10)
def test_ci_requires_the_root_tests_before_it_runs_the_suite():
    lines = [shlex.split(line, comments=True) for line in CI_RUN.read_text().splitlines()]
    required = next(i for i, w in enumerate(lines) if w == ["export", f"{REQUIRE_ROOT_TESTS}=1"])
    assert required < lines.index(["make", "test"])


@pytest.mark.timeout(10)
def test_where_root_tests_are_required_a_missing_lab_fails_instead_of_skipping(monkeypatch):
    monkeypatch.setattr(
        netns, "_availability", "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    )
    monkeypatch.delenv(REQUIRE_ROOT_TESTS, raising=False)
    assert netns_skip_reason() == netns._availability  # a developer's machine: they skip, saying why
    monkeypatch.setenv(REQUIRE_ROOT_TESTS, "1")
    assert netns_skip_reason() is None  # CI: they run...
    with pytest.raises(NetnsError, match="need root"):
        NetLab("ciguard", 1)  # ...and fail, saying why
