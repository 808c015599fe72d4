# ruff: noqa: RUF001  (multilingual test text)
"""Tiny GGUF vocabularies and the strings we tokenize with them, to compare our tokenizers to llama.cpp's.

The vocabularies are trained here, on CORPUS: SentencePiece ones with the `sentencepiece` package (written
with scores and token types as llama.cpp's converter writes them), a byte-level BPE one with `tokenizers`'
trainer. They are written as vocabulary-only GGUF files (no tensors: llama-tokenize loads only the
vocabulary) into tests/data/tokenizers/, with llama-tokenize's ids for every string of TEXTS in
<family>.json beside them (scripts/record-gguf-tokenizers.py). Every BPE pre-tokenizer uses the one BPE
vocabulary, its `tokenizer.ggml.pre` changed (`with_pre`).
"""

from __future__ import annotations

import io
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from shardline.models.gguf_tokenizer_spm import spm_merges

DATA_DIR = Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizers"

# Kept small and varied: the vocabularies learn from it, so the test strings hit real merges.
CORPUS = """\
The quick brown fox jumps over the lazy dog. It's what they've said: we'll see, I'd think, you're right.
Tokenizers split text into pieces; the pieces become ids, and the ids go to the model.
In 2024 the cluster served 1234567 requests at 99.95% availability, 3.14 ms per token, 42 nodes.
Le cœur déçu mais l'âme plutôt naïve, Louÿs rêva de crapaüter en canoë au delà des îles.
Größenordnung der Straßenbahn: über die Brücke, schön und groß. Ça va très bien, merci beaucoup.
¿Dónde está la estación de tren? ¡Qué día tan bonito! A ação rápida e o coração.
我们今天去北京天安门广场，然后吃烤鸭。中文分词是一个有趣的问题。今天天气很好。
東京は日本の首都です。ひらがなとカタカナと漢字を使います。ありがとうございます。
안녕하세요, 세계! 한국어 문장입니다. 감사합니다. 오늘 날씨가 좋네요.
مرحبا بالعالم! هذه جملة عربية. شكرا جزيلا لكم على المساعدة.
Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.
नमस्ते दुनिया, यह हिंदी का वाक्य है। धन्यवाद।
Γειά σου Κόσμε! Η γρήγορη καφέ αλεπού πηδάει.
Emoji: 🤖 🚀 👍🏽 ❤️ 😀 🎉 and flags 🇫🇷 🇯🇵 in text, 👨‍👩‍👧‍👦 family.
def tokenize(text: str) -> list[int]:
    return [vocab[piece] for piece in text.split()]

class Model:
    def __init__(self, layers=12, heads=8):
        self.layers = layers  # number of blocks
        self.heads = heads

if __name__ == "__main__":
    print(tokenize("hello world"), Model().layers)
int main(int argc, char **argv) {
\tfor (int i = 0; i < argc; ++i) { printf("%s\\n", argv[i]); }
\treturn 0;
}
{"model": "tiny", "layers": [1, 2, 3], "ratio": 0.5, "ok": true, "name": null}
HTTPServerError parseJSONValue XMLHttpRequest getElementById iPhone McDonald's camelCaseWords
https://example.com/path/to/page?query=value&other=2#section
0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2048 4096 65536 1000000 3.5 -7 +8 1e10
"""

_DIGITS = " ".join("123456789012"[:n] for n in range(1, 13))  # digit runs of 1 to 12
TEXTS: tuple[str, ...] = (
    "Hello world",
    " Hello world",
    "Hello  world   ",
    "   ",
    "\n",
    " \n \n",
    "\tindented\ttabs\t\t",
    "line one\nline two\n\n\nline five\r\nend",
    "   leading and trailing spaces   \n",
    'def add(a, b):\n    return a + b\n\n\nif __name__ == "__main__":\n        print(add(1, 2))  # sum\n',
    "int main() {\n\tfor (int i = 0; i < 10; ++i) { x[i] = y->z; }\n\treturn 0;\n}\n",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null, "b": "x\\ny"}}',
    _DIGITS,
    "3.14159 and 2,718 and 1e-9 and 0x1F and 007 and 1000000",
    "Le cœur déçu mais l'âme plutôt naïve, Louÿs rêva de crapaüter en canoë au delà des îles.",
    "Größenordnung Straßenbahnhaltestelle ÜBERMÄSSIG übermäßig",
    "¿Dónde está la estación? ¡Ação rápida!",
    "我们今天去北京天安门广场，然后吃烤鸭。",
    "東京は日本の首都です。ひらがなとカタカナ、漢字。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "مرحبا بالعالم! هذه جملة عربية.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "नमस्ते दुनिया, यह हिंदी है।",
    "Γειά σου Κόσμε",
    "I ❤️ tokenizers 🤖🚀👍🏽 and 👨‍👩‍👧‍👦 families",
    "I'm sure they'll say it's what we've done, DON'T YOU'LL SEE'S",
    "HTTPServerError parseJSONValue XMLHttpRequest iPhone McDonald's",
    "e\u0301 vs \u00e9, a\u00a0b and c\u3000d",
    "aaaaaaaaaaaaaaaa !!!!!!! ........ ----------",
    "https://example.com/path?q=1&r=2#frag",
)


@dataclass(frozen=True)
class Family:
    """One recorded tokenizer: a vocabulary file, the pre-tokenizer put in it (BPE), its special strings."""

    name: str
    vocab: str  # file name in DATA_DIR
    pre: str | None = None  # BPE: `tokenizer.ggml.pre` written into a copy of the vocabulary

    def texts(self) -> tuple[str, ...]:
        return TEXTS + SPECIAL_TEXTS[self.vocab]


SPECIAL_TEXTS: dict[str, tuple[str, ...]] = {
    "bpe.gguf": (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "text<tool_call>{}</tool_call> <|endoftext|>",
        "done</s> next",
    ),
    "spm.gguf": ("<s>[INST] hello [/INST]</s>", "a<sep>b <sep> c"),
    "gemma.gguf": ("<start_of_turn>user\nHi\n\n  there<end_of_turn>\n<start_of_turn>model\n",),
    "gemma4.gguf": ("<start_of_turn>user\nHi\n\n  there<end_of_turn>\n<start_of_turn>model\n",),
    "phi3.gguf": ("<|user|>\n  Hi there<|end|>\n<|assistant|>  ok</s> x", "<s> <|endoftext|>  y"),
}

BPE_PRES: tuple[str, ...] = (
    "default", "llama-bpe", "dbrx", "jais-2", "deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon",
    "starcoder", "refact", "command-r", "smollm", "gpt-2", "olmo", "qwen2", "qwen35", "bloom", "chatglm-bpe",
    "glm4", "viking", "tekken", "gpt-4o", "bailingmoe", "seed-coder", "ufakzeka", "grok-2", "laguna",
    "exaone-moe", "minicpm5",
)  # fmt: skip
FAMILIES: tuple[Family, ...] = (
    Family("spm-llama", "spm.gguf"),
    Family("spm-gemma", "gemma.gguf"),
    Family("spm-phi3", "phi3.gguf"),
    Family("gemma4", "gemma4.gguf"),
    *(Family(f"bpe-{pre}", "bpe.gguf", pre) for pre in BPE_PRES),
)


# ---- vocabularies ------------------------------------------------------------------------------------------


def _corpus_lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line.strip()]


def train_spm(*, user_defined: list[str], control: list[str], vocab_size: int = 900) -> dict[str, Any]:
    """A SentencePiece BPE vocabulary as llama.cpp's converter writes it: pieces, scores, types."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_lines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        user_defined_symbols=user_defined,
        control_symbols=control,
        minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    return {
        "tokens": [p.piece for p in proto.pieces],
        "scores": [p.score for p in proto.pieces],
        "token_type": [int(p.type) for p in proto.pieces],  # the same numbering as GGUF's token types
    }


WHOLE_WORDS = (" HTTPServerError", " parseJSONValue", "東京は", " übermäßig", "Hello")


def train_bpe(*, specials: list[tuple[str, int]], vocab_size: int = 1400) -> dict[str, Any]:
    """A byte-level BPE vocabulary whose merges cross letter, digit and punctuation boundaries (trained on
    whitespace-separated words), so that each pre-tokenizer's splitting changes the ids."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\S+|\s+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([*_corpus_lines(), CORPUS], trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    # Whole words no merge makes: llama3 and tekken look a piece up whole before merging, others never.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for word in WHOLE_WORDS:
        (piece, _), *_ = byte_level.pre_tokenize_str(word)
        if piece not in tokens:
            tokens.append(piece)
    types = [1] * len(tokens)
    for text, kind in specials:
        tokens.append(text)
        types.append(kind)
    return {"tokens": tokens, "token_type": types, "merges": merges}


def write_vocab_gguf(path: Path, name: str, model: str, vocab: dict[str, Any], **keys: Any) -> None:
    """A vocabulary-only GGUF (llama hyperparameters, no tensors), as llama.cpp's models/ggml-vocab-*.gguf."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(16)
    writer.add_vocab_size(len(vocab["tokens"]))
    writer.add_tokenizer_model(model)
    if pre := keys.get("pre"):
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["token_type"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    for key in ("bos", "eos", "unknown", "padding"):
        if (value := keys.get(f"{key}_token_id")) is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if (value := keys.get(key)) is not None:
            writer.add_bool(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_vocab(path: Path) -> dict[str, Any]:
    """The metadata of a vocabulary GGUF as plain values (what build_tokenizer takes)."""
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def with_pre(src: Path, dst: Path, pre: str) -> None:
    """A copy of the BPE vocabulary `src` whose `tokenizer.ggml.pre` is `pre`."""
    meta = read_vocab(src)
    vocab = {k: meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges")}
    keys = {k.removeprefix("tokenizer.ggml."): v for k, v in meta.items() if k.endswith(("_id", "_token"))}
    write_vocab_gguf(dst, str(meta["general.name"]), "gpt2", vocab, pre=pre, **keys)


def make_vocabularies(into: Path) -> None:
    """Train and write the four vocabularies (deterministic for the pinned trainers)."""
    into.mkdir(parents=True, exist_ok=True)
    control, user = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
    bpe = train_bpe(
        specials=[
            ("<|endoftext|>", control),
            ("<|im_start|>", control),
            ("<|im_end|>", control),
            ("<tool_call>", user),
            ("</tool_call>", user),
            # Typed normal, but llama.cpp makes it a control token by its text.
            ("</s>", gguf.TokenType.NORMAL),
        ]
    )
    n = len(bpe["tokens"])
    write_vocab_gguf(
        into / "bpe.gguf", "tiny-bpe", "gpt2", bpe, pre="gpt-2", bos_token_id=n - 5, eos_token_id=n - 4
    )
    spm = train_spm(user_defined=["<sep>"], control=["[INST]", "[/INST]"])
    write_vocab_gguf(
        into / "spm.gguf", "tiny-llama", "llama", spm, bos_token_id=1, eos_token_id=2, unknown_token_id=0
    )
    # Gemma: no prefix space, whitespace runs as user-defined tokens, turns as control tokens.
    gemma = train_spm(
        user_defined=["\n\n", "▁▁", "▁▁▁▁", "\t\t"], control=["<start_of_turn>", "<end_of_turn>"]
    )
    write_vocab_gguf(
        into / "gemma.gguf", "tiny-gemma", "llama", gemma,
        bos_token_id=1, eos_token_id=2, unknown_token_id=0, add_space_prefix=False, add_bos_token=True,
    )  # fmt: skip
    # Gemma 4 keeps such a vocabulary as a BPE on characters, with merges (here: those of the scores).
    merges = [f"{a} {b}" for a, b in spm_merges(gemma["tokens"], gemma["scores"])]
    write_vocab_gguf(
        into / "gemma4.gguf", "tiny-gemma4", "gemma4", gemma | {"merges": merges},
        bos_token_id=1, eos_token_id=2, unknown_token_id=0,
    )  # fmt: skip
    # Phi-3 (by its name): llama.cpp strips the whitespace after most of its special tokens.
    phi3 = train_spm(user_defined=[], control=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"])
    write_vocab_gguf(
        into / "phi3.gguf", "Phi3", "llama", phi3, bos_token_id=1, eos_token_id=2, unknown_token_id=0
    )


# ---- llama.cpp's side --------------------------------------------------------------------------------------


def llama_tokenize(exe: Path, vocab: Path, text: str, timeout: float = 60) -> list[int]:
    """llama-tokenize's ids for `text` (its defaults: BOS as the vocabulary says, special tokens parsed)."""
    done = subprocess.run(
        [str(exe), "-m", str(vocab), "--stdin", "--ids", "--no-escape", "--log-disable"],
        input=text.encode(),
        capture_output=True,
        timeout=timeout,
        check=True,
    )
    lines = [line for line in done.stdout.decode().splitlines() if line.startswith("[")]
    return json.loads(lines[-1])


def llama_version(exe: Path) -> str:
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, check=False)
    return next((line for line in (done.stdout + done.stderr).splitlines() if "version" in line), "unknown")


def family_vocab(family: Family, tmp: Path) -> Path:
    """The GGUF llama-tokenize reads for `family`: the stored one, or a copy with its pre-tokenizer."""
    src = DATA_DIR / family.vocab
    if family.pre is None:
        return src
    dst = tmp / f"{family.name}.gguf"
    if not dst.exists():
        with_pre(src, dst, family.pre)
    return dst


def family_meta(family: Family) -> dict[str, Any]:
    meta = read_vocab(DATA_DIR / family.vocab)
    if family.pre is not None:
        meta["tokenizer.ggml.pre"] = family.pre
    return meta


def record(exe: Path, tmp: Path, families: tuple[Family, ...] = FAMILIES) -> Iterator[Path]:
    """Run llama-tokenize on every family's strings; write DATA_DIR/<family>.json; yield each path."""
    version = llama_version(exe)
    for family in families:
        vocab = family_vocab(family, tmp)
        cases = [{"text": text, "ids": llama_tokenize(exe, vocab, text)} for text in family.texts()]
        out = DATA_DIR / f"{family.name}.json"
        doc = {"family": family.name, "vocab": family.vocab, "pre": family.pre, "llama_cpp": version}
        out.write_text(dump(doc, cases))
        yield out


def dump(doc: dict[str, Any], cases: list[dict[str, Any]]) -> str:
    """JSON with one line per case, so that a diff shows which strings changed."""
    head = json.dumps(doc, ensure_ascii=False, indent=1)[:-2]
    lines = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in cases)
    return f'{head},\n "cases": [\n  {lines}\n ]\n}}\n'


def recorded(family: Family) -> dict[str, Any]:
    return json.loads((DATA_DIR / f"{family.name}.json").read_text())
