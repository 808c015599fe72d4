"""Every mlx-lm text architecture as 1, 2 and 3 stages and batched, against mlx-lm's own forward
(testing/arch_matrix.py): what fails is exactly what compute/pipeline_limits.py says, and nothing else."""

from __future__ import annotations

import pytest

from shardline.compute.pipeline_limits import PIPELINE_REFUSED, REFUSED, pipeline_refusal
from shardline.testing import arch_matrix, arch_zoo

# Architectures the zoo cannot make a model of (mlx-lm serves them from what a random model lacks).
UNBUILT = {"prism_hadamard_qwen35": "Unsupported Hadamard pack"}  # a Hadamard-rotated 2-bit pack's modules

# The stages' bugs today: the checks each fails and a piece of its error. A fix fails this test until its
# entry goes, so that the matrix says what runs.
ALL = set(arch_matrix.CHECKS)
KNOWN_BUGS: dict[str, tuple[set[str], str]] = {}


@pytest.fixture(scope="module")
def rows() -> list[arch_matrix.MatrixRow]:
    return arch_matrix.matrix()


@pytest.mark.timeout(600)  # the matrix itself, shared by the tests below: ~1.5 minutes on 2 cores
def test_the_matrix_covers_every_architecture(rows: list[arch_matrix.MatrixRow]) -> None:
    print("\n" + arch_matrix.table(rows))
    assert [r.arch for r in rows] == arch_zoo.architectures()
    for r in rows:
        assert set(r.results) == (set() if r.refused else ALL), r
        assert all(v.strip() and "\n" not in v for v in r.results.values()), r
        ran = {c for c, v in r.results.items() if v == arch_matrix.OK}
        assert all(set(r.paths[c].split(",")) <= {"fast", "generic"} for c in ran), r
        one = 1 if r.arch in PIPELINE_REFUSED else 2
        stages = {"S1": 1, "S2": 2, "S3": 3, "batched": one, "resume": one}
        assert all(len(r.paths[c].split(",")) == stages[c] for c in ran), r


@pytest.mark.timeout(60)
def test_what_mlx_lm_itself_cannot_run_is_refused(rows: list[arch_matrix.MatrixRow]) -> None:
    refused = {r.arch: r.refused for r in rows if r.refused}
    assert set(refused) == set(REFUSED) | set(UNBUILT), refused
    for arch, piece in UNBUILT.items():
        assert piece in refused[arch]
    assert not set(REFUSED) & set(PIPELINE_REFUSED)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", arch_matrix.CHECKS)
def test_each_check_fails_exactly_where_the_tables_say(rows: list[arch_matrix.MatrixRow], check: str) -> None:
    failed = {r.arch: r.results[check] for r in rows if r.failed(check)}
    bugs = {a for a, (checks, _) in KNOWN_BUGS.items() if check in checks}
    refused = set(PIPELINE_REFUSED) if check in ("S2", "S3") else set()
    expected = bugs | refused
    assert set(failed) == expected, {
        "fails, not in the tables": {a: failed[a] for a in set(failed) - expected},
        "in the tables, runs": sorted(expected - set(failed)),
    }
    for arch in bugs - refused:
        assert KNOWN_BUGS[arch][1] in failed[arch], (arch, failed[arch])


@pytest.mark.timeout(60)
def test_llama_shaped_models_keep_the_fast_path(rows: list[arch_matrix.MatrixRow]) -> None:
    by_arch = {r.arch: r for r in rows}
    for arch in ("llama", "qwen2", "qwen3"):
        assert set(by_arch[arch].paths.values()) == {"fast", "fast,fast", "fast,fast,fast"}, by_arch[arch]
    # The fast path's own check sends a model it does not compute exactly to the generic one: granite's
    # blocks look llama-shaped, but it scales its embedding, residuals and logits.
    assert by_arch["granite"].paths.get("S2") == "generic,generic", by_arch["granite"]


@pytest.mark.timeout(10)
def test_pipeline_refusal_says_why_in_one_line() -> None:
    assert pipeline_refusal("llama", 3) == ""
    assert pipeline_refusal("hunyuan", 1) == ""
    assert "one stage only" in pipeline_refusal("hunyuan", 2)
    assert pipeline_refusal("bitnet", 1) == REFUSED["bitnet"]
    assert all("\n" not in why for why in (*PIPELINE_REFUSED.values(), *REFUSED.values()))
