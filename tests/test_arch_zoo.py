"""The zoo of tiny random models, one per mlx-lm text architecture, and which of them mlx-lm runs on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.testing import arch_zoo
from shardline.testing.arch_configs import WRAPPERS

# Every architecture that builds and runs deterministically today: a regression in any of them fails.
RUNS = {
    "Klear", "afm7", "afmoe", "apertus", "baichuan_m1", "bailing_hybrid", "bailing_moe", "bailing_moe_linear",
    "bailing_moe_v3", "cohere", "cohere2", "dbrx", "deepseek", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "deepseek_v41", "dots1", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon_h1",
    "gear", "gemma", "gemma2", "gemma3_text", "gemma3n", "gemma4_text", "glm", "glm4", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt2", "gpt_bigcode", "gpt_neox", "gpt_oss", "gptj", "granite",
    "granitemoe", "granitemoehybrid", "helium", "hunyuan", "hunyuan_v1_dense", "internlm2", "internlm3",
    "iquestloopcoder", "jamba", "kimi_k3", "kimi_linear", "laguna", "lfm2", "lfm2_moe", "lille-130m", "llama",
    "llama4_text", "longcat_flash", "longcat_flash_ngram", "mamba", "mamba2", "mellum", "mimo",
    "mimo_v2_flash", "minicpm", "minicpm3", "minimax", "minimax_m3_vl", "ministral3", "mistral4", "mixtral",
    "muse_glimmer", "nanbeige", "nanochat", "nemotron-nas", "nemotron", "nemotron_h", "olmo2", "olmo3",
    "olmo_hybrid", "olmoe", "openelm", "phi", "phi3", "phimoe", "phixtral", "plamo", "plamo2", "plamo3",
    "qwen", "qwen2", "qwen2_moe", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "recurrent_gemma", "rwkv7", "seed_oss", "smollm3", "solar_open", "spark2_5", "stablelm", "starcoder2",
    "step3p5", "talkie", "telechat3", "youtu_llm",
}  # fmt: skip


@pytest.fixture(scope="module")
def rows() -> list[arch_zoo.ArchRow]:
    return arch_zoo.survey()


def test_the_zoo_covers_every_text_architecture_file() -> None:
    models = Path(arch_zoo._models_dir())
    found = arch_zoo.architectures()
    assert len(found) >= 100 and {"llama", "deepseek_v3", "qwen3_next", "mamba", "gpt_oss"} <= set(found)
    for wrapper, sibling in WRAPPERS.items():
        assert (models / f"{wrapper}.py").exists() and sibling in found and wrapper not in found
    assert not {"base", "cache", "switch_layers", "rope_utils", "activations", "pipeline"} & set(found)


@pytest.mark.timeout(180)
def test_survey_runs_every_architecture_it_ran_before(rows: list[arch_zoo.ArchRow]) -> None:
    assert [r.arch for r in rows] == arch_zoo.architectures()
    running = {r.arch for r in rows if r.runs}
    print("\n" + arch_zoo.table(rows))
    assert running >= RUNS, f"no longer run: {sorted(RUNS - running)}"
    assert len(running) >= len(RUNS)
    for r in rows:
        assert r.runs == (r.reason == ""), r
        assert r.runs <= r.builds and (r.kind == "?") == (not r.builds), r
        if not r.runs:
            assert r.reason.strip() and "\n" not in r.reason, r


@pytest.mark.timeout(120)
def test_a_written_directory_loads_through_mlx_lm_with_the_same_tokens(tmp_path: Path) -> None:
    from mlx_lm import load

    for arch in ("llama", "qwen3_moe", "deepseek_v3"):
        model, config = arch_zoo.build(arch, seed=3)
        loaded, tokenizer = load(str(arch_zoo.write(arch, tmp_path / arch, seed=3)))
        assert arch_zoo.generate(loaded)[0] == arch_zoo.generate(model)[0], arch
        assert tokenizer.encode("hi") and config["model_type"] == arch
