"""Rebuild a Hugging Face `tokenizer.json` from the vocabulary stored in a GGUF file.

GGUF keeps byte-level BPE vocabularies in the same byte-to-unicode form as HF
(`Ġ` for a leading space), so tokens and merges carry over unchanged; only the
pre-tokenizer has to be chosen from `tokenizer.ggml.pre`, the name llama.cpp
gives to each family's splitting regex.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from shardline.models.errors import UnsupportedModelError

# llama.cpp token types (gguf.TokenType); CONTROL tokens are the model's special tokens.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The splitting regexes of the HF tokenizers these `pre` names stand for.
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
SUPPORTED_PRE = ("gpt2", "smollm", "qwen2", *LLAMA3_PRE)


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    """Pre-tokenizer (and normalizer, if any) matching llama.cpp's `pre` name."""
    if pre in ("gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None
    if pre == "smollm":
        # SmolLM splits every digit on its own, then applies the GPT-2 regex.
        return (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            ),
            None,
        )
    regex = QWEN2_REGEX if pre == "qwen2" else LLAMA3_REGEX if pre in LLAMA3_PRE else None
    if regex is None:
        raise UnsupportedModelError(
            f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE)})"
        )
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # Qwen's HF tokenizer NFC-normalizes its input; llama3's does not.
    normalizer = normalizers.NFC() if pre == "qwen2" else None
    return pre_tokenizers.Sequence([split, byte_level]), normalizer


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Build the HF tokenizer described by the `tokenizer.ggml.*` keys of a GGUF file."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2', is)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # keep the first id if a GGUF repeats a token string

    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    pre_tok, normalizer = _pre_tokenizer(pre)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            # llama3 looks a whole word up before merging; llama.cpp does the same for llama-bpe.
            ignore_merges=pre in LLAMA3_PRE,
        )
    )
    tok.pre_tokenizer = pre_tok
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()

    # Registered as added tokens so that the text "<|im_end|>" is matched whole, never BPE-split.
    added = [
        AddedToken(tokens[i], special=t == TOKEN_TYPE_CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict[str, Any], context_length: int | None) -> dict[str, Any]:
    """The `tokenizer_config.json` transformers' AutoTokenizer (and so mlx-lm) reads."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if context_length:
        config["model_max_length"] = context_length
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config
