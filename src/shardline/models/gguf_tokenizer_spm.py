"""SentencePiece vocabularies of GGUF files (`tokenizer.ggml.model == "llama"`) as a `tokenizers` BPE.

llama.cpp tokenizes these (llm_tokenizer_spm) without the SentencePiece library: spaces become `▁`, a `▁`
is prepended to every run of text that starts the input or follows a special token (when
`tokenizer.ggml.add_space_prefix`, true unless the file says otherwise), the text is split into UTF-8
characters, and the adjacent pair whose concatenation is the vocabulary's highest-scoring token is merged,
again and again (ties: the leftmost pair); a character that is no token becomes its `<0xNN>` byte tokens.

That is a BPE whose merges are every split of every token into two tokens, ranked by the token's score:
the same merges become possible in the same order. One case cannot be written as ranks: two different
pairs of equal score that overlap (llama.cpp takes the leftmost, we take the one of the lower token id).
Real SentencePiece vocabularies give every token its own score, so it only concerns tokens of equal,
usually zero, score (user-defined ones).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import decoders, models, normalizers

SPACE = "▁"  # SentencePiece's visible space


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens whose concatenation is a token, best merged token first."""
    ids: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        ids.setdefault(tok, i)
    ranked: list[tuple[float, int, int, str, str]] = []
    for tok, i in ids.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[i]), i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_model(tokens: Sequence[str], scores: Sequence[float], unk: str | None) -> models.BPE:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores),
        unk_token=unk if unk in vocab else None,
        fuse_unk=True,
        # llama.cpp's resegment: characters that are no token fall back to their UTF-8 bytes.
        byte_fallback="<0x00>" in vocab,
    )


def spm_normalizer(add_space_prefix: bool) -> normalizers.Normalizer:
    """Spaces to `▁`, with llama.cpp's prefix space: the normalizer runs on each text piece between
    special tokens, which is where llama.cpp adds it (it adds none to an empty piece, nor does Prepend)."""
    replace = normalizers.Replace(" ", SPACE)
    if not add_space_prefix:
        return replace
    return normalizers.Sequence([normalizers.Prepend(SPACE), replace])


def spm_decoder(add_space_prefix: bool) -> decoders.Decoder:
    """The decoder of HF's Llama/Gemma tokenizers (mlx-lm recognises it and picks its SPM detokenizer)."""
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)
