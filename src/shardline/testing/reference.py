"""Single-process mlx-lm generation: the ground truth sharded output is compared against."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from shardline.compute.gguf_linear import load_model

# How far a quantized model's logits may stray from the same weights' float32 product, over the largest
# logit: on CPU the native kernel rounds activations to int16 per block of 32 (at most max|x_block| / 65534
# per element); tiny models measured 1e-4 to 2e-4 after a few layers.
QUANTIZED_LOGIT_TOLERANCE = 1e-3
# The same for GGUF blocks as stored (compute/gguf_linear.py): their products round x to int8 per block of
# 32, as llama.cpp does (at most max|x_block| / 254 per element); tiny models measured 1e-2 to 3e-2.
BLOCKS_LOGIT_TOLERANCE = 6e-2


class Reference:
    def __init__(self, model_dir: Path) -> None:
        self.model, self.config = load_model(Path(model_dir))

    def greedy(
        self, prompt: list[int], max_tokens: int, prefill_step: int = 2048
    ) -> tuple[list[int], list[float]]:
        """Greedy tokens and, per token, the margin between the best and second-best logit."""
        tokens, margins, _ = self.greedy_logprobs(prompt, max_tokens, prefill_step)
        return tokens, margins

    def greedy_logprobs(
        self, prompt: list[int], max_tokens: int, prefill_step: int = 2048
    ) -> tuple[list[int], list[float], list[mx.array]]:
        """Greedy tokens, their margins, and the log-probabilities each one was chosen from."""
        tokens, margins, dists = [], [], []
        for tok, logprobs in generate_step(
            mx.array(prompt),
            self.model,
            max_tokens=max_tokens,
            sampler=lambda x: mx.argmax(x, axis=-1),
            prefill_step_size=prefill_step,
        ):
            top2 = mx.sort(logprobs)[-2:]
            margins.append(float(top2[1] - top2[0]))
            tokens.append(int(tok))
            dists.append(logprobs.astype(mx.float32))
        return tokens, margins, dists

    def last_logits(self, prompt: list[int]) -> mx.array:
        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array([prompt]), cache=cache)
        return logits[0, -1].astype(mx.float32)
