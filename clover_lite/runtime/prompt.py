"""A prompt as token ids: the one rule both engines follow (README, Python API)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from clover_lite.errors import GenerationError
from clover_lite.tokenizer.tokenizer import Tokenizer, check_text

Prompt = str | Sequence[int] | Sequence[dict]


def no_tokenizer_error(path: str | Path) -> GenerationError:
    """Text given to a model without tokenizer files."""
    return GenerationError(f"{path}: the model has no tokenizer files (tokenizer.json or tokenizer.model); copy "
                           "them from the model it was made from, or pass token ids instead of text")


def prompt_ids(prompt: Prompt, tokenizer: Tokenizer | None, vocab_size: int, *, raw: bool = False,
               add_generation_prompt: bool = True, path: Path | None = None) -> list[int]:
    """Token ids for a prompt: a string (a user message through the chat template when the model has one;
    with `raw`, or without a template, encoded as is), a list of token ids (checked against the vocabulary),
    or chat messages (list of {"role", "content"} dicts, rendered with the chat template). `path` names the
    model in the error for text given to a model without tokenizer files."""

    def tok() -> Tokenizer:
        if tokenizer is None:
            raise no_tokenizer_error(path)
        return tokenizer

    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        if raw or not tok().has_chat_template:
            return tok().encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise GenerationError(f"prompt must be a string, a list of token ids, or a list of chat message dicts, "
                              f"not {type(prompt).__name__}" + ("; decode bytes to str first"
                                                                 if isinstance(prompt, (bytes, bytearray)) else ""))
    items = list(prompt)
    if items and all(isinstance(m, dict) for m in items):
        for k, m in enumerate(items):
            if isinstance(m.get("content"), str):
                check_text(m["content"], f"message {k}")
        return tok().encode(tok().apply_chat_template(items, add_generation_prompt=add_generation_prompt))
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        bad = [t for t in items if not 0 <= t < vocab_size]
        if bad:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        return [int(t) for t in items]
    raise GenerationError("prompt must be a string, a list of token ids, or a list of chat message dicts")
