"""Write a tiny, deterministic byte-level tokenizer for test and demo checkpoints.

The vocabulary is the 256 byte symbols (id == byte value) plus a few special tokens, with no merges, so
any text round-trips exactly and no training data is needed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from clover_lite.errors import TokenizerError

DEFAULT_SPECIALS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

PAD_TOKEN = "<|endoftext|>"

# ChatML: one block per message, then an open assistant block when asked for a generation prompt.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """The GPT-2 byte-to-unicode table: entry b is the printable symbol ByteLevel uses for byte b."""
    # Printable latin-1 bytes stand for themselves; the rest are shifted past 255 so none is whitespace.
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols: dict[int, str] = {}
    shift = 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def build_byte_tokenizer(special_tokens: list[str] = DEFAULT_SPECIALS) -> HFTokenizer:
    """A `tokenizers.Tokenizer` with ids 0..255 for the bytes and 256.. for `special_tokens`."""
    _check_specials(special_tokens)
    vocab = {symbol: b for b, symbol in enumerate(byte_symbols())}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # normalized=False: a special token must match the raw text, never a byte-mapped form of it.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tokenizer


def write_byte_tokenizer(
    out_dir: str | os.PathLike,
    special_tokens: list[str] = DEFAULT_SPECIALS,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    eos_token: str = "<|im_end|>",
    mask_token: str = "<|mask|>",
) -> int:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`; return the vocab size.

    `chat_template=None` writes a tokenizer without a chat template.
    """
    _check_specials(special_tokens)
    for name, token in (("eos_token", eos_token), ("mask_token", mask_token)):
        if token not in special_tokens:
            raise TokenizerError(
                f"write_byte_tokenizer: {name} {token!r} is not one of the special tokens {special_tokens}; "
                f"add it to special_tokens or pick one of them as {name}."
            )
    tokenizer = build_byte_tokenizer(special_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))

    write_tokenizer_config(out, tokenizer, special_tokens, eos_token, mask_token, chat_template, 1 << 30)
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _check_specials(special_tokens: list[str]) -> None:
    if isinstance(special_tokens, str) or not all(isinstance(t, str) and t for t in special_tokens):
        raise TokenizerError(
            f"write_byte_tokenizer: special_tokens must be a list of non-empty strings, "
            f"got {special_tokens!r}."
        )
    if len(set(special_tokens)) != len(special_tokens):
        raise TokenizerError(
            f"write_byte_tokenizer: special_tokens {special_tokens} has duplicates; list each token once."
        )
    # A one-character special equal to a byte symbol would reuse that byte's id instead of getting its own.
    clashes = [t for t in special_tokens if t in byte_symbols()]
    if clashes:
        raise TokenizerError(
            f"write_byte_tokenizer: special tokens {clashes} are byte symbols already in the base vocab; "
            "use multi-character special tokens such as '<|name|>'."
        )


def write_tokenizer_config(
    out_dir: str | os.PathLike,
    tokenizer: HFTokenizer,
    special_tokens: list[str],
    eos_token: str,
    mask_token: str,
    chat_template: str | None,
    model_max_length: int,
) -> None:
    """tokenizer_config.json for a `tokenizers` tokenizer: its special tokens (ids looked up in it), eos,
    pad, mask and the chat template (none when None)."""
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in special_tokens
        },
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": PAD_TOKEN if PAD_TOKEN in special_tokens else None,
        "mask_token": mask_token,
        # Exact round-trips: no "clean up" of spaces before punctuation on decode.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(Path(out_dir) / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
