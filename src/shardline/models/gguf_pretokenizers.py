# ruff: noqa: RUF001  (llama.cpp's regexes and token texts are full of look-alike characters)
"""The BPE pre-tokenizers of llama.cpp, by the `tokenizer.ggml.pre` name a GGUF file carries.

Each name stands for a list of splitting regexes that llama.cpp (src/llama-vocab.cpp, llm_tokenizer_bpe)
applies one after the other, every regex splitting the pieces the previous one left, matches and the text
between them alike. A `tokenizers` Sequence of `Split(..., "isolated")` does the same, with Oniguruma, whose
`\\p{L}`, `\\p{N}`, `\\s` are Unicode-wide as llama.cpp's category tables are. The regexes are llama.cpp's own
(its adaptations of each model's tokenizer.json regex included, e.g. the lookaheads that stand for
`\\p{Lu}`/`\\p{Ll}` in tekken and gpt-4o): where they differ from the model's original regex on some input,
llama.cpp's tokenization of the GGUF is the one we reproduce. One change: a `$` (end of line for Oniguruma)
is written `\\z`, the end of the piece, which is what llama.cpp's std::regex sees.
"""

from __future__ import annotations

from dataclasses import dataclass

# The regex of GPT-2 (llama.cpp's spelling: no trailing `|\s+`; whitespace it leaves is a piece anyway).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# deepseek-llm's letters: the Latin, Greek, Cyrillic, ... ranges of its tokenizer.json, as code points (some
# of them are not in NFC, which an editor or a formatter could silently change).
_DEEPSEEK_LETTER_RANGES = (
    (0x41, 0x5A),
    (0x61, 0x7A),
    (0xB5, 0xB5),
    (0xC0, 0xD6),
    (0xD8, 0xF6),
    (0xF8, 0x1BA),
    (0x1BC, 0x1BF),
    (0x1C4, 0x293),
    (0x295, 0x2AF),
    (0x370, 0x373),
    (0x376, 0x376),
    (0x377, 0x377),
    (0x37B, 0x37D),
    (0x37F, 0x37F),
    (0x386, 0x386),
    (0x388, 0x38A),
    (0x38C, 0x38C),
    (0x38E, 0x3A1),
    (0x3A3, 0x3F5),
    (0x3F7, 0x481),
    (0x48A, 0x52F),
    (0x531, 0x556),
    (0x10A0, 0x10C5),
    (0x13A0, 0x13F5),
    (0x13F8, 0x13FD),
    (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B),
    (0x1D6B, 0x1D77),
    (0x1D79, 0x1D9A),
    (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45),
    (0x1F48, 0x1F4D),
    (0x1F50, 0x1F57),
    (0x1F59, 0x1F59),
    (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D),
    (0x1F5F, 0x1F7D),
    (0x1F80, 0x1FB4),
    (0x1FB6, 0x1FBC),
    (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4),
    (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3),
    (0x1FD6, 0x1FDB),
    (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4),
    (0x1FF6, 0x1FFC),
    (0x2102, 0x2102),
    (0x2107, 0x2107),
    (0x210A, 0x2113),
    (0x2115, 0x2115),
    (0x2119, 0x211D),
    (0x2124, 0x2124),
    (0x2126, 0x2126),
    (0x2128, 0x2128),
    (0x212A, 0x212D),
    (0x212F, 0x2134),
    (0x2139, 0x2139),
    (0x213C, 0x213F),
    (0x2145, 0x2149),
    (0x214E, 0x214E),
    (0x2183, 0x2183),
    (0x2184, 0x2184),
    (0x2C00, 0x2C7B),
    (0x2C7E, 0x2CE4),
    (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF2),
    (0x2CF3, 0x2CF3),
    (0xA640, 0xA66D),
    (0xA680, 0xA69B),
    (0xA722, 0xA76F),
    (0xA771, 0xA787),
    (0xA78B, 0xA78E),
    (0xAB70, 0xABBF),
    (0xFB00, 0xFB06),
    (0xFB13, 0xFB17),
    (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A),
    (0x10400, 0x1044F),
    (0x104B0, 0x104D3),
    (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2),
    (0x10CC0, 0x10CF2),
    (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)
_DEEPSEEK_LETTERS = "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_LETTER_RANGES)
_CJK_HANGUL = "[一-龥ࠀ-一가-\ud7ff]+"
_CJK_KANA = "[一-龥\u3040-ゟ゠-ヿ]+"
_DEEPSEEK3 = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER_THEN_LOWER = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_UPPER_ONLY = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_SCANDINAVIAN = " ?[^(\\s|.,!?…。，、।۔،)]+"
_WS_CASCADE = "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
_WS_CASCADE += r"|\s{1,2}(?!\S)|\s{1}"


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: its regexes and the vocabulary flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # look a whole piece up before merging (llama3, tekken)
    add_bos: bool = False  # llama.cpp's default when the GGUF does not say


_TYPES: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "llama3": PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizer((LLAMA3,)),
    "jais2": PreTokenizer(
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            + _WS_CASCADE,
        )
    ),
    "deepseek-llm": PreTokenizer(
        (
            "[\r\n]",
            rf"\s?[{_DEEPSEEK_LETTERS}]+",
            "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
            r"\s+\z",
            _CJK_HANGUL,
            r"\p{N}+",
        )
    ),
    "deepseek-v3": PreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3)),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "starcoder": PreTokenizer((r"\p{N}", GPT2)),
    "gpt2": PreTokenizer((GPT2,)),
    "qwen2": PreTokenizer((QWEN2,)),
    "qwen35": PreTokenizer((QWEN35,)),
    "bloom": PreTokenizer((_SCANDINAVIAN,)),
    "chatglm4": PreTokenizer((LLAMA3,)),
    "glm4": PreTokenizer((LLAMA3,), ignore_merges=True),
    "viking": PreTokenizer((_SCANDINAVIAN, r"\p{N}")),
    "tekken": PreTokenizer(
        (
            _UPPER_THEN_LOWER
            + "|"
            + _UPPER_ONLY
            + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
        add_bos=True,
    ),
    "gpt-4o": PreTokenizer(
        (
            _UPPER_THEN_LOWER
            + _CONTRACTIONS
            + "?|"
            + _UPPER_ONLY
            + _CONTRACTIONS
            + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "bailingmoe": PreTokenizer(
        (
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "seed-coder": PreTokenizer(
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    # Qwen2's regex less its English contractions.
    "ufakzeka": PreTokenizer(
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", QWEN2)),
    "exaone-moe": PreTokenizer(
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
            r"|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "minicpm5": PreTokenizer(
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
}

# `tokenizer.ggml.pre` -> type, as llama.cpp's llama_vocab::impl::load maps them.
_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        "llama3",
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    "jais-2": "jais2",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek-v3"),
    "falcon": "falcon",
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        "starcoder",
    ),
    **dict.fromkeys(
        (
            # "gpt2" is not a llama.cpp name (it says "gpt-2"), but GGUFs in the wild and our tests carry it.
            "gpt2",
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        "gpt2",
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
        "qwen2",
    ),
    "qwen35": "qwen35",
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "bloom"),
    "chatglm-bpe": "chatglm4",
    **dict.fromkeys(("glm4", "glm5"), "glm4"),
    "viking": "viking",
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt-4o"),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "seed-coder": "seed-coder",
    "grok-2": "qwen2",
    "ufakzeka": "ufakzeka",
    "laguna": "laguna",
    "exaone-moe": "exaone-moe",
    "minicpm5": "minicpm5",
}

SUPPORTED_PRE: tuple[str, ...] = tuple(sorted(_NAMES))
# One name per distinct type: what the tests check against llama.cpp.
TYPE_NAMES: dict[str, str] = {t: next(n for n, tt in _NAMES.items() if tt == t) for t in _TYPES}


def pre_tokenizer_for(pre: str) -> PreTokenizer | None:
    """The pre-tokenizer of llama.cpp's `pre` name, or None when it is not one we rebuild."""
    kind = _NAMES.get(pre)
    return None if kind is None else _TYPES[kind]
