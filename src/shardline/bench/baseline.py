"""Single-process mlx-lm, run as its own pinned process: the baseline every ratio is taken against.

Usage: python -m shardline.bench.baseline MODEL_DIR PROMPT_IDS_JSON PREFILL_STEP MAX_TOKENS
Prints one JSON line: prefill seconds (time to first token) and per-token decode timestamps.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model


def main() -> None:
    model_arg, prompt_json, prefill_step, max_tokens = sys.argv[1:5]
    model_dir = Path(model_arg)
    prompt = json.loads(prompt_json)
    model, _ = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.eos_token_ids = []  # measure exactly max_tokens steps, like the engine run beside it
    # Warm-up, as the engine's runners do before they report ready.
    for _ in stream_generate(model, tokenizer, prompt[:8], max_tokens=2):
        pass
    mx.reset_peak_memory()
    start = time.perf_counter()
    stamps = []
    for _ in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=int(max_tokens),
        prefill_step_size=int(prefill_step),
        sampler=lambda x: mx.argmax(x, axis=-1),
    ):
        stamps.append(time.perf_counter() - start)
    print(json.dumps({"stamps": stamps, "peak_bytes": mx.get_peak_memory()}))


if __name__ == "__main__":
    main()
