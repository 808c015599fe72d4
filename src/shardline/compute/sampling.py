"""Token sampling as a pure function of (logits, settings, position): replaying a request reproduces it."""

from __future__ import annotations

import math
from typing import Annotated

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from shardline.compute import fastmath, quantized
from shardline.compute.constraints import Constraint

# OpenAI's bounds for logit_bias: at most this many tokens, each biased by at most this much either way. A
# request's settings travel once to the stage that samples; these keep them a few kilobytes.
MAX_LOGIT_BIAS = 300
MAX_BIAS = 100.0
BiasToken = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    repetition_context: int = Field(20, ge=0)
    # OpenAI's penalties: over the tokens generated so far, `presence` once per distinct token and
    # `frequency` once per occurrence are subtracted from its logit.
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int = 0
    top_logprobs: int = Field(0, ge=0, le=20)
    # OpenAI's logit_bias: (token, bias) pairs added to the logits before anything else; each token once.
    logit_bias: tuple[tuple[BiasToken, Bias], ...] = Field((), max_length=MAX_LOGIT_BIAS)
    # A grammar the output must follow (compute/constraints.py): the sampler masks what it forbids.
    constraint: Constraint | None = None

    @field_validator("logit_bias")
    @classmethod
    def _once_each(cls, bias: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token more than once")
        return bias

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalises_output(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_output(self) -> bool:
        """Whether sampling reads the tokens generated so far (a row must carry them)."""
        return self.penalises_output or self.constraint is not None


class Sampled(BaseModel):
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = []


def _key(seed: int, position: int) -> mx.array:
    # One independent stream per (seed, position): no sampler state survives between steps.
    return mx.random.key((seed * 1_000_003 + position) % (2**63))


def apply_repetition_penalty(logits: mx.array, context: list[int], penalty: float) -> mx.array:
    if penalty == 1.0 or not context:
        return logits
    # A new array: the caller's logits (returned to clients as logits) must not change.
    hit = mx.zeros(logits.shape, dtype=mx.bool_)
    hit[mx.array(sorted(set(context)))] = True
    penalised = mx.where(logits < 0, logits * penalty, logits / penalty)
    return mx.where(hit, penalised, logits)


def apply_output_penalties(
    logits: mx.array, output: list[int], presence: float, frequency: float
) -> mx.array:
    if not output or (presence == 0.0 and frequency == 0.0):
        return logits
    counts = mx.zeros(logits.shape, dtype=mx.float32)
    counts = counts.at[mx.array(output)].add(1.0)
    return logits - counts * frequency - (counts > 0).astype(mx.float32) * presence


NUCLEUS_CANDIDATES = 1024  # the nucleus is looked for among this many best tokens first


def _largest(values: mx.array, k: int) -> mx.array:
    """Indices of the k largest values, largest first, without sorting them all."""
    if k <= 0:
        return mx.array([], mx.uint32)
    if k >= values.shape[0]:
        return mx.argsort(-values)
    idx = mx.argpartition(-values, kth=k - 1)[:k]
    return idx[mx.argsort(-values[idx])]


def _nucleus(scaled: mx.array, top_p: float) -> mx.array:
    """Keep the most likely tokens while the mass strictly above each is below top_p (top-p sampling).

    The kept tokens are a prefix of the sorted order, so when the best candidates already hold top_p of
    the mass, nothing past them can be kept: sorting them alone gives the same set as sorting everything
    (a full sort of a large vocabulary costs more than the rest of a decode step's sampling)."""
    probs_all = mx.softmax(scaled)
    order = _largest(scaled, min(NUCLEUS_CANDIDATES, scaled.shape[0]))
    probs = probs_all[order]
    if order.shape[0] < scaled.shape[0] and probs.sum().item() < top_p:
        order = mx.argsort(-scaled)
        probs = probs_all[order]
    before = mx.cumsum(probs) - probs  # mass strictly above each candidate
    keep = mx.zeros(scaled.shape, dtype=mx.bool_)
    keep[order] = before < top_p
    return mx.where(keep, scaled, -math.inf)


Pick = tuple[mx.array, mx.array, mx.array, mx.array]  # token, its logprob, top indices, their logprobs


def apply_logit_bias(logits: mx.array, bias: tuple[tuple[int, float], ...]) -> mx.array:
    if not bias:
        return logits
    pairs = [(t, b) for t, b in bias if 0 <= t < logits.shape[-1]]
    if not pairs:
        return logits
    add = mx.zeros(logits.shape, dtype=logits.dtype)
    add[mx.array([t for t, _ in pairs])] = mx.array([b for _, b in pairs], dtype=logits.dtype)
    return logits + add


def apply_mask(logits: mx.array, allowed: mx.array | None) -> mx.array:
    """Forbidden tokens get -inf: before temperature and top-p, so those see only what the grammar allows."""
    return logits if allowed is None else mx.where(allowed, logits, -math.inf)


def _pick(
    logits: mx.array,
    params: SamplingParams,
    position: int,
    context: list[int],
    output: list[int] | None,
    allowed: mx.array | None = None,
) -> Pick:
    """The lazy graph of one token's choice: nothing is evaluated here."""
    logits = apply_logit_bias(logits, params.logit_bias)
    logits = apply_repetition_penalty(logits, context, params.repetition_penalty)
    logits = apply_output_penalties(logits, output or [], params.presence_penalty, params.frequency_penalty)
    logits = apply_mask(logits, allowed)
    # On CPU the vocabulary's exp is most of a greedy step's sampling, and MLX's runs element by element.
    on_cpu = mx.default_device() == mx.cpu
    ops = quantized.native() if on_cpu else None
    if params.greedy and not params.top_logprobs and ops is not None and logits.dtype == mx.float32:
        # The argmax and its log-probability in one pass over the vocabulary: one op, not a dozen.
        chosen, picked = ops.greedy(logits)
        return chosen, picked, mx.array([], mx.uint32), mx.array([], mx.float32)
    logprobs = logits - (fastmath.logsumexp(logits) if on_cpu else mx.logsumexp(logits))
    if params.greedy:
        chosen = mx.argmax(logits)
    else:
        scaled = logits / params.temperature
        if params.top_k and params.top_k < scaled.shape[0]:
            at = scaled.shape[0] - params.top_k  # the k-th largest value, without sorting them all
            kth = mx.partition(scaled, kth=at)[at]
            scaled = mx.where(scaled < kth, -math.inf, scaled)
        if params.min_p > 0.0:
            floor = scaled.max() + math.log(params.min_p)
            scaled = mx.where(scaled < floor, -math.inf, scaled)
        if params.top_p < 1.0:
            scaled = _nucleus(scaled, params.top_p)
        chosen = mx.random.categorical(scaled, key=_key(params.seed, position))
    idx = _largest(logprobs, params.top_logprobs)
    return chosen, logprobs[chosen], idx, logprobs[idx]


def _sampled(pick: Pick) -> Sampled:
    chosen, picked, idx, top_lp = pick
    top = list(zip(idx.tolist(), top_lp.tolist(), strict=True))
    return Sampled(token=int(chosen.item()), logprob=float(picked.item()), top_logprobs=top)


def sample(
    logits: mx.array,
    params: SamplingParams,
    position: int,
    context: list[int],
    output: list[int] | None = None,
    allowed: mx.array | None = None,
) -> Sampled:
    """logits: (vocab,) float32 of the position before `position`. Returns the token placed at `position`.

    `context`: the recent tokens the repetition penalty looks at; `output`: the tokens generated so far
    (for the presence and frequency penalties); `allowed`: (vocab,) bool, the tokens a constraint allows
    (see compute/constraints.py), None when unconstrained."""
    return sample_many([(logits, params, position, context, output, allowed)])[0]


# logits, settings, position, context, output, allowed tokens
SampleArgs = tuple[mx.array, SamplingParams, int, list[int], list[int] | None, mx.array | None]


def sample_many(rows: list[SampleArgs]) -> list[Sampled]:
    """Each row sampled as sample() would alone, in one evaluation: every sync costs a decode step."""
    picks = [_pick(*row) for row in rows]
    mx.eval(*(a for pick in picks for a in pick))
    return [_sampled(pick) for pick in picks]
