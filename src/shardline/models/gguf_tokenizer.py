# ruff: noqa: RUF001  (llama.cpp's regexes and token texts are full of look-alike characters)
"""Rebuild a Hugging Face `tokenizer.json` from the vocabulary stored in a GGUF file.

llama.cpp's tokenization of the file is the reference (src/llama-vocab.cpp); the tests compare ours to
`llama-tokenize`'s ids, recorded in tests/data/tokenizers/. Two kinds of vocabulary:

- byte-level BPE (`tokenizer.ggml.model == "gpt2"`): GGUF keeps tokens and merges in the same
  byte-to-unicode form as HF (`Ġ` for a leading space), so they carry over unchanged; the pre-tokenizer is
  chosen from `tokenizer.ggml.pre` (gguf_pretokenizers.py). As llama.cpp, no Unicode normalization.
- SentencePiece (`"llama"`: llama 2, mistral, gemma, phi-3): rebuilt from tokens, scores and token types
  (gguf_tokenizer_spm.py).
- Gemma 4 (`"gemma4"`): a BPE on UTF-8 characters with `▁` for spaces, its merges in the file.

Special tokens are those llama.cpp splits the text on before tokenizing: control, user-defined and
unknown tokens, matched in the raw text (llama-tokenize parses special tokens, as HF does by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shardline.models.errors import UnsupportedModelError
from shardline.models.gguf_pretokenizers import SUPPORTED_PRE, pre_tokenizer_for
from shardline.models.gguf_tokenizer_spm import spm_decoder, spm_model, spm_normalizer

# llama.cpp token types (gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Tokens llama.cpp makes control tokens by their text, whatever type the file gives them (end of turn,
# end of generation, fill-in-the-middle markers: llama_vocab::impl::load).
FORCED_CONTROL = frozenset(
    (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "</s>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
        "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|eom_id|>",
        "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<eos>", "<turn|>", "<|tool_response>", "[e~[",
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
        "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>",
        "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>",
        "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
        "<|file_sep|>",
    )
)  # fmt: skip
# gpt-oss's channel markers, which llama.cpp always renders (user-defined).
FORCED_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# Phi-3: llama.cpp strips the whitespace after its special tokens, but for these.
PHI3_NO_RSTRIP = frozenset({"<unk>", "<s>", "<|endoftext|>"})


@dataclass(frozen=True)
class Specials:
    """Which tokens are special, and which ids the tokenizer adds around a text, as llama.cpp decides."""

    control: list[int]  # control and unknown tokens: HF special tokens (skipped when decoding)
    user_defined: list[int]  # split on like special tokens, but decoded as text
    rstrip: set[int]  # eat the whitespace that follows them (phi-3)
    bos: int | None
    eos: int | None
    add_bos: bool
    add_eos: bool


def _token_id(meta: dict[str, Any], key: str, default: int | None, n: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id", default)
    return int(value) if value is not None and 0 <= int(value) < n else None


def specials(meta: dict[str, Any]) -> Specials:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    spm = meta.get("tokenizer.ggml.model") == "llama"
    present = set(tokens)
    forced_user, forced_normal = set(FORCED_USER_DEFINED), set()
    # gpt-oss (o200k_harmony) and solar-open: their "<|end|>" does not end generation; it is user-defined.
    if "<|end|>" in present and (
        {"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present
    ):
        forced_user.add("<|end|>")
    # gemma4 and plamo: "</s>" is a normal token.
    if "</s>" in present and present & {"<|tool_response>", "<|plamo:eos|>"}:
        forced_normal.add("</s>")
    control, user_defined = [], []
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=False)):
        if tok in forced_normal:
            continue
        if tok in forced_user:
            user_defined.append(i)
        elif kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) or tok in FORCED_CONTROL:
            control.append(i)
        elif kind == TOKEN_TYPE_USER_DEFINED:
            user_defined.append(i)
    rstrip: set[int] = set()
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        rstrip = {i for i in control + user_defined if tokens[i] not in PHI3_NO_RSTRIP}
        rstrip |= {i for i, tok in enumerate(tokens) if tok == "</s>"}
    if spm:
        default_bos = True
    else:
        pre = pre_tokenizer_for(meta.get("tokenizer.ggml.pre", "default"))
        default_bos = pre is not None and pre.add_bos
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    n = len(tokens)
    return Specials(
        control=control,
        user_defined=user_defined,
        rstrip=rstrip,
        # llama.cpp's defaults for SentencePiece vocabularies when the file names none.
        bos=_token_id(meta, "bos", 1 if spm else None, n),
        eos=_token_id(meta, "eos", 2 if spm else None, n),
        # Gemma 4 always starts with its BOS in llama.cpp, whatever the file says.
        add_bos=add_bos or meta.get("tokenizer.ggml.model") == "gemma4",
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        cut = m.find(" ", 1)  # as llama.cpp splits them
        merges.append((m[:cut], m[cut + 1 :]) if cut > 0 else ("", ""))
    return merges


def _bpe(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    pre = pre_tokenizer_for(pre_name)
    if pre is None:
        raise UnsupportedModelError(
            f"GGUF tokenizer pre-tokenizer {pre_name!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_PRE)})"
        )
    merges = _merges(meta)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # keep the first id if a GGUF repeats a token string
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre.ignore_merges)
    tok = Tokenizer(model)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm(meta: dict[str, Any], tokens: list[str], unk: int | None) -> Tokenizer:
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok = Tokenizer(spm_model(tokens, scores, tokens[unk] if unk is not None else None))
    tok.normalizer = spm_normalizer(add_space_prefix)
    tok.decoder = spm_decoder(add_space_prefix)
    return tok


def _gemma4(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    """Gemma 4's BPE: on UTF-8 characters (not GPT-2's bytes), spaces as `▁`, split only at newline runs;
    llama.cpp looks a newline run up whole, which matching the vocabulary's runs as added tokens does
    (a run longer than any in the vocabulary is split differently: longest runs first, not by merges)."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta), fuse_unk=False, byte_fallback=True))
    tok.normalizer = spm_normalizer(add_space_prefix=False)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = spm_decoder(add_space_prefix=False)
    tok.add_tokens([AddedToken(t, normalized=False) for t in vocab if t and t.strip("\n") == ""])
    return tok


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Build the HF tokenizer described by the `tokenizer.ggml.*` keys of a GGUF file."""
    kind = meta.get("tokenizer.ggml.model")
    # llama.cpp names empty tokens so; they cannot be matched anyway.
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(meta["tokenizer.ggml.tokens"])]
    if kind == "gpt2":
        tok = _bpe(meta, tokens)
    elif kind == "gemma4":
        tok = _gemma4(meta, tokens)
    elif kind == "llama":
        tok = _spm(meta, tokens, _token_id(meta, "unknown", 0, len(tokens)))
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece; 'gemma4')"
        )
    sp = specials(meta)

    # Added tokens are matched in the raw text before anything else, so "<|im_end|>" is never split.
    def added(i: int, special: bool) -> AddedToken:
        return AddedToken(tokens[i], special=special, normalized=False, rstrip=i in sp.rstrip)

    tok.add_special_tokens([added(i, True) for i in sp.control])
    tok.add_tokens([added(i, False) for i in sp.user_defined])

    single, pair, ids = "$A:0", "$A:0 $B:1", []
    if sp.add_bos and sp.bos is not None:
        single, pair = f"{tokens[sp.bos]}:0 {single}", f"{tokens[sp.bos]}:0 $A:0 {tokens[sp.bos]}:1 $B:1"
        ids.append((tokens[sp.bos], sp.bos))
    if sp.add_eos and sp.eos is not None:
        single, pair = f"{single} {tokens[sp.eos]}:0", f"{pair} {tokens[sp.eos]}:1"
        ids.append((tokens[sp.eos], sp.eos))
    if ids:
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict[str, Any], context_length: int | None) -> dict[str, Any]:
    """The `tokenizer_config.json` transformers' AutoTokenizer (and so mlx-lm) reads."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    sp = specials(meta)
    spm = meta.get("tokenizer.ggml.model") == "llama"

    def token(key: str, default: int | None = None) -> str | None:
        idx = _token_id(meta, key, default, len(tokens))
        return tokens[idx] if idx is not None else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[sp.bos] if sp.bos is not None else None,
        "eos_token": tokens[sp.eos] if sp.eos is not None else None,
        "unk_token": token("unknown", 0 if spm else None),
        "pad_token": token("padding"),
        "add_bos_token": sp.add_bos,
        "add_eos_token": sp.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if context_length:
        config["model_max_length"] = context_length
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config
