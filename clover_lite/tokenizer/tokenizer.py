"""Load a model's tokenizer (tokenizer.json or tokenizer.model) and render its chat template.

Only the files in a checkpoint directory are read; nothing comes from the network. The chat template is
rendered the way transformers renders it, so prompts match what the model was trained on.
"""

from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
import sentencepiece
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from clover_lite.errors import TokenizerError
from clover_lite.tokenizer.incremental import IncrementalDecoder


def not_text(text: str) -> str | None:
    """What makes `text` unreadable to a tokenizer, or None: a lone UTF-16 surrogate, which is how Python shows
    argv or stdin bytes that are not UTF-8 (and JSON's "\\ud800" escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(text[e.start]):04X} at character {e.start}, which is not text"
    return None


def check_text(text: str, what: str) -> None:
    """TokenizerError naming `what` when `text` is not text (not_text)."""
    problem = not_text(text)
    if problem:
        raise TokenizerError(f"{what} holds {problem} (bytes that are not UTF-8, read from a terminal, pipe or "
                             "file?); pass UTF-8 text")


TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def has_tokenizer_files(model_dir: str | os.PathLike) -> bool:
    """Whether `model_dir` holds a tokenizer either backend reads (without them a model takes token ids only)."""
    return any((Path(model_dir) / f).exists() for f in (TOKENIZER_JSON, SENTENCEPIECE_MODEL))

# Names under which checkpoints commonly ship the diffusion mask token, in order of preference.
MASK_TOKEN_CANDIDATES = ("<|mask|>", "<|MASK|>", "[MASK]", "<mask>", "<|mask_token|>")

# Special tokens transformers exposes to chat templates as variables (when they are set).
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")

# Older names for a message's reasoning; transformers copies them to the ones templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _HFBackend:
    """A Hugging Face `tokenizers` tokenizer.json."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self.tok = tok
        added = tok.get_added_tokens_decoder()
        self.added = {t.content: i for i, t in added.items()}
        self.special_ids = {i for i, t in added.items() if t.special}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # Byte-level and Metaspace decodes map each token on its own (bar the first token's space); others, such
        # as ByteFallback (a later byte can turn a whole run of byte tokens into U+FFFD), are not known local.
        self.decodes_locally = isinstance(tok.decoder, (tokenizers.decoders.ByteLevel, tokenizers.decoders.Metaspace))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def special_token_id(self, token: str) -> int | None:
        return self.added.get(token)


class _SPBackend:
    """A sentencepiece tokenizer.model plus the added tokens listed in tokenizer_config.json."""

    def __init__(self, sp: sentencepiece.SentencePieceProcessor, added: dict[int, tuple[str, bool]]) -> None:
        self.sp = sp
        self.sp_size = sp.get_piece_size()
        self.added_by_id = {i: content for i, (content, _) in added.items()}
        self.added = {content: i for i, (content, _) in added.items()}
        # sentencepiece's own control and unknown pieces (<s>, </s>, <unk>) count as special too.
        self.special_ids = {i for i, (_, special) in added.items() if special}
        self.special_ids |= {i for i in range(self.sp_size) if sp.is_control(i) or sp.is_unknown(i)}
        self.vocab_size = max([self.sp_size, *(i + 1 for i in added)])
        # Pieces decode on their own but for the space a text's first piece drops; byte pieces one character at a
        # time. So the text after a clean boundary depends only on whether some text comes before it.
        self.decodes_locally = True
        # Longest first, so an added token that contains another one wins.
        names = sorted(self.added, key=len, reverse=True)
        self.split_re = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.split_re is None:
            return self.sp.encode(text, out_type=int)
        ids: list[int] = []
        # re.split with a capturing group alternates plain text (even indices) and added tokens (odd ones).
        for k, part in enumerate(self.split_re.split(text)):
            if k % 2:
                ids.append(self.added[part])
            elif part:
                ids.extend(self.sp.encode(part, out_type=int))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if skip_special_tokens and i in self.special_ids:
                continue
            if i in self.added_by_id:
                out.append(self.sp.decode(run))
                run = []
                out.append(self.added_by_id[i])
            elif i < self.sp_size:
                run.append(i)
            else:
                raise TokenizerError(
                    f"Token id {i} is neither a sentencepiece piece (0..{self.sp_size - 1}) nor an added "
                    f"token in {TOKENIZER_CONFIG}; decode only ids the tokenizer produced or that the model "
                    f"sampled inside the tokenizer's vocab."
                )
        out.append(self.sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        i = self.sp.piece_to_id(token)
        # piece_to_id answers unk_id for pieces it does not know.
        if i == self.sp.unk_id() and token != self.sp.id_to_piece(i):
            return None
        return i

    def special_token_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        i = self.token_to_id(token)
        if i is not None and (self.sp.is_control(i) or self.sp.is_user_defined(i)):
            return i
        return None


class Tokenizer:
    """Text <-> token ids, special token ids and chat template rendering for one checkpoint directory."""

    def __init__(
        self,
        backend: _HFBackend | _SPBackend,
        config: dict[str, Any],
        generation_config: dict[str, Any],
        chat_template: str | None,
        chat_template_source: str,
        config_path: str,
    ) -> None:
        self._backend = backend
        self._config_path = config_path
        self._chat_template = chat_template
        self._chat_template_source = chat_template_source
        self._compiled: jinja2.Template | None = None
        self.vocab_size: int = backend.vocab_size
        self.special_token_ids: set[int] = set(backend.special_ids)

        self._token_strings = {name: self._config_token(config, name) for name in _TEMPLATE_TOKEN_NAMES}
        sp = backend.sp if isinstance(backend, _SPBackend) else None
        self.bos_token_id: int | None = self._config_token_id("bos_token")
        if self.bos_token_id is None and sp is not None and "bos_token" not in config and sp.bos_id() >= 0:
            self.bos_token_id = sp.bos_id()
        self.pad_token_id: int | None = self._config_token_id("pad_token")
        if self.pad_token_id is None and sp is not None and "pad_token" not in config and sp.pad_id() >= 0:
            self.pad_token_id = sp.pad_id()
        self.mask_token_id: int | None = self._config_token_id("mask_token")
        if self.mask_token_id is None:
            found = (backend.special_token_id(t) for t in MASK_TOKEN_CANDIDATES)
            self.mask_token_id = next((i for i in found if i is not None), None)

        eos: list[int] = []
        config_eos = self._config_token_id("eos_token")
        if config_eos is not None:
            eos.append(config_eos)
        elif sp is not None and "eos_token" not in config and sp.eos_id() >= 0:
            eos.append(sp.eos_id())
        eos.extend(_generation_eos_ids(generation_config, config_path))
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))

        # tokenizer.json carries its own post-processor for bos/eos (transformers ignores add_bos_token
        # there too); only the bare sentencepiece path needs the flags.
        self._add_bos = sp is not None and _config_flag(config, "add_bos_token", config_path)
        self._add_eos = sp is not None and _config_flag(config, "add_eos_token", config_path)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json (preferred) or tokenizer.model, plus the optional config files, from `path`."""
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(
                f"Tokenizer directory {root} does not exist or is not a directory; pass the checkpoint "
                f"directory that holds {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL}."
            )
        config_path = root / TOKENIZER_CONFIG
        config = _read_json(config_path) if config_path.is_file() else {}
        gen_path = root / GENERATION_CONFIG
        gen_config = _read_json(gen_path) if gen_path.is_file() else {}

        if (root / TOKENIZER_JSON).is_file():
            backend: _HFBackend | _SPBackend = _load_tokenizers(root / TOKENIZER_JSON)
        elif (root / SENTENCEPIECE_MODEL).is_file():
            added = _added_tokens(config, str(config_path))
            backend = _SPBackend(_load_sentencepiece(root / SENTENCEPIECE_MODEL), added)
        else:
            raise TokenizerError(
                f"No tokenizer found in {root}: looked for {TOKENIZER_JSON} (Hugging Face tokenizers) and "
                f"{SENTENCEPIECE_MODEL} (sentencepiece). Copy the tokenizer files of the original model "
                f"into this directory."
            )
        template, source = _find_chat_template(root, config)
        return cls(backend, config, gen_config, template, source, str(config_path))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the model's bos/eos the way its config asks."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}; pass the prompt text.")
        check_text(text, "the text")
        ids = self._backend.encode(text, add_special_tokens)
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self._add_eos and self.eos_token_ids:
                ids = [*ids, self.eos_token_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; `skip_special_tokens` drops eos, pad, mask and the like."""
        try:
            ids = [operator.index(i) for i in ids]
        except TypeError as e:
            raise TokenizerError(f"decode() takes int token ids ({e}); pass a list of ints.") from e
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(
                f"Token ids {bad[:8]} are outside the tokenizer's vocab (0..{self.vocab_size - 1}); the "
                f"model sampled or was given ids its tokenizer does not know; mask logits past the vocab."
            )
        return self._backend.decode(ids, skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A decoder of a growing id list whose text is always `decode(ids, skip_special_tokens)`: decoding a few
        ids at its end per push where this tokenizer's decode is local, else re-decoding all of them."""
        return IncrementalDecoder(lambda ids: self.decode(ids, skip_special_tokens),
                                  windowed=self._backend.decodes_locally)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry or added token, or None when there is none."""
        return self._backend.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) into the model's prompt text, like transformers."""
        template = self._compile_template()
        chat = _check_messages(messages)
        if tools is not None and (
            not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)
        ):
            raise TokenizerError(
                f"tools must be a list of JSON-schema dicts, got {tools!r}; convert each tool to its schema."
            )
        variables: dict[str, Any] = {k: v for k, v in self._token_strings.items() if v is not None}
        variables["documents"] = None
        variables.update(kwargs)
        variables.update(messages=chat, add_generation_prompt=add_generation_prompt, tools=tools)
        try:
            return template.render(**variables)
        except _TemplateRaised as e:
            raise TokenizerError(
                f"The chat template from {self._chat_template_source} rejected the conversation: "
                f"{e.message}. Change the messages (roles, order, fields) to what this template accepts."
            ) from None
        except Exception as e:
            raise TokenizerError(
                f"Rendering the chat template from {self._chat_template_source} failed: "
                f"{type(e).__name__}: {e}. Check the messages and template options, or fix the template."
            ) from e

    def _compile_template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise TokenizerError(
                f"This model has no chat template (looked for {CHAT_TEMPLATE_FILE} and a chat_template entry "
                f"in {TOKENIZER_CONFIG}); pass a plain prompt string instead of chat messages."
            )
        if self._compiled is None:
            self._compiled = _compile_chat_template(self._chat_template, self._chat_template_source)
        return self._compiled

    def _config_token(self, config: dict[str, Any], name: str) -> str | None:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None or isinstance(value, str):
            return value
        raise TokenizerError(
            f'{self._config_path}: {name} must be a token string or {{"content": ...}}, got {value!r}; '
            f"fix or remove that entry."
        )

    def _config_token_id(self, name: str) -> int | None:
        # A token named in the config but missing from the vocab is left unset rather than guessed.
        token = self._token_strings[name]
        return None if token is None else self._backend.token_to_id(token)


class _TemplateRaised(Exception):
    """raise_exception() called from inside a chat template."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '); chat templates need the plain JSON transformers emits.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(template: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(
            f"The chat template in {source} has a syntax error at line {e.lineno}: {e.message}. "
            f"Fix the template there, or pass a plain prompt string instead of chat messages."
        ) from e


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate messages and copy them the way transformers does before rendering."""
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(
            f'messages must be a list of {{"role": ..., "content": ...}} dicts, got '
            f"{type(messages).__name__}; for a plain prompt string, skip the chat template and encode it."
        )
    chat = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise TokenizerError(
                f'messages[{k}] must be a dict with "role" and "content" keys, got {message!r}; '
                f'write each message as {{"role": "user", "content": "..."}}.'
            )
        if not isinstance(message["role"], str):
            raise TokenizerError(
                f'messages[{k}]["role"] must be a string such as "user", got {message["role"]!r}.'
            )
        # transformers drops None values (OpenAI-style content=None), which templates handle as missing keys.
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[f] for f in _REASONING_FIELDS if message.get(f) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(
            f"Could not read {path}: {e}. The file is corrupt or truncated; re-download it from the "
            f"original model (or delete it if it is optional)."
        ) from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}; re-download it.")
    return data


def _load_tokenizers(path: Path) -> _HFBackend:
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for parse errors
        raise TokenizerError(
            f"Could not parse {path}: {e}. The file is corrupt, truncated, a Git LFS pointer, or from a "
            f"newer tokenizers version; re-download it from the original model."
        ) from e
    return _HFBackend(tok)


def _load_sentencepiece(path: Path) -> sentencepiece.SentencePieceProcessor:
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(model_file=str(path))
    except Exception as e:  # sentencepiece raises OSError or RuntimeError depending on the failure
        raise TokenizerError(
            f"Could not parse {path} as a sentencepiece model: {e}. The file is corrupt, truncated or a "
            f"Git LFS pointer; re-download it from the original model."
        ) from e
    return sp


def _added_tokens(config: dict[str, Any], config_path: str) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) from tokenizer_config.json's added_tokens_decoder."""
    raw = config.get("added_tokens_decoder") or {}
    if not isinstance(raw, dict):
        raise TokenizerError(
            f"{config_path}: added_tokens_decoder must map ids to token dicts; fix or remove the entry."
        )
    added: dict[int, tuple[str, bool]] = {}
    for key, entry in raw.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not str(key).isdigit() or not isinstance(content, str) or not content:
            raise TokenizerError(
                f"{config_path}: added_tokens_decoder entry {key!r}: {entry!r} is not "
                f'"<id>": {{"content": "<token>", "special": true|false}}; fix the entry.'
            )
        added[int(key)] = (content, bool(entry.get("special", False)))
    return added


def _find_chat_template(root: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """The chat template text and where it came from; chat_template.jinja wins, as in transformers 5."""
    jinja_path = root / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"Could not read {jinja_path}: {e}; re-save it as UTF-8 text.") from e
    source = f"{root / TOKENIZER_CONFIG} (chat_template)"
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value, source
    # Older checkpoints store several named templates; "default" is the one for plain chat.
    if isinstance(value, list) and value and all(_is_named_template(t) for t in value):
        chosen = next((t for t in value if t["name"] == "default"), value[0])
        return chosen["template"], f"{root / TOKENIZER_CONFIG} (chat_template {chosen['name']!r})"
    raise TokenizerError(
        f'{source} must be a template string or a non-empty list of {{"name", "template"}} dicts, '
        f"got {value!r}; fix the entry or put the template in {CHAT_TEMPLATE_FILE}."
    )


def _is_named_template(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    return isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)


def _generation_eos_ids(generation_config: dict[str, Any], config_path: str) -> list[int]:
    value = generation_config.get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        path = Path(config_path).with_name(GENERATION_CONFIG)
        raise TokenizerError(
            f"{path}: eos_token_id must be an int or a list of ints, got {value!r}; fix the entry."
        )
    return list(values)


def _config_flag(config: dict[str, Any], name: str, config_path: str) -> bool:
    value = config.get(name, False)
    if not isinstance(value, bool):
        raise TokenizerError(f"{config_path}: {name} must be true or false, got {value!r}; fix the entry.")
    return value
