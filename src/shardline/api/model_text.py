"""The model's text, from text to tokens: its chat template, its tokenizer, the prompt of a conversation.

The way back, tokens to text for a stream, is api/text_stream.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardline.api.tools.prompt import Tool, function_spec, generic_messages, template_takes_tools


@dataclass
class ModelText:
    name: str
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    context_length: int
    vocab_size: int
    family: str = ""

    @property
    def eos(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict[str, Any]], tools: tuple[Tool, ...] = ()) -> list[int]:
        """The prompt of a conversation (with tool calls and results, see api/tools/prompt.py)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template and template_takes_tools(template):  # the model's own tool format
            specs = [function_spec(t) for t in tools] or None
            text = self.tokenizer.apply_chat_template(
                messages, tools=specs, add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        messages = generic_messages(messages, tools)
        if template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        # No template: a plain transcript that ends where the assistant speaks.
        text = "".join(f"{msg['role']}: {msg['content']}\n" for msg in messages) + "assistant:"
        return self.tokenizer.encode(text)

    def text(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)


def load_model_text(model_dir: Path) -> ModelText:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    tokenizer = load_tokenizer(model_dir)
    return ModelText(
        name=model_dir.name,
        tokenizer=tokenizer,
        context_length=int(config.get("max_position_embeddings") or 2048),
        vocab_size=int(config.get("vocab_size") or len(tokenizer.get_vocab())),
        family=str(config.get("model_type", "")),
    )
