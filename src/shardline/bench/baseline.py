"""Single-process mlx-lm, run as its own pinned process: the baseline every ratio is taken against.

Usage: python -m shardline.bench.baseline MODEL_DIR PREFILL_STEP
It loads the model once, then answers requests, one JSON line each on stdin: {"prompt": [ids], "max_tokens":
N}. Each answer is one JSON line: per-token timestamps (the first is the prefill) and the peak memory. Kept
running beside the engines, it is measured right before the engine run it is compared with.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shardline.compute.gguf_linear import load_model


def main() -> None:
    model_arg, prefill_step = sys.argv[1:3]
    model_dir = Path(model_arg)
    model, _ = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.eos_token_ids = []  # measure exactly max_tokens steps, like the engine run beside it
    # Warm-up, as the engine's runners do before they report ready.
    for _ in stream_generate(model, tokenizer, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=2):
        pass
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        mx.reset_peak_memory()
        start = time.perf_counter()
        stamps = []
        for _ in stream_generate(
            model,
            tokenizer,
            request["prompt"],
            max_tokens=int(request["max_tokens"]),
            prefill_step_size=int(prefill_step),
            sampler=lambda x: mx.argmax(x, axis=-1),
        ):
            stamps.append(time.perf_counter() - start)
        print(json.dumps({"stamps": stamps, "peak_bytes": mx.get_peak_memory()}), flush=True)


if __name__ == "__main__":
    main()
