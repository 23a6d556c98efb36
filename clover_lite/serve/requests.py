"""OpenAI-style request bodies, checked field by field into what the engine runs.

Every problem is one ApiError naming the field and the fix; nothing here touches the engine's weights, so
a bad request is refused before it waits in the queue. The standard fields map onto GenerationConfig; our
own settings go in the one extension field `clover` (README: "clover serve").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clover_lite.errors import CloverError
from clover_lite.tokenizer.tokenizer import not_text

# OpenAI fields this server accepts only at their neutral value: clients send them with defaults, and a
# request that asks for more than the runtime does is refused instead of silently ignored.
NEUTRAL = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "logit_bias": (None, {}),
    "best_of": (1, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "parallel_tool_calls": (None, False, True),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
}
# Fields with no effect on the output: accepted and ignored.
IGNORED = ("user",)
# `clover` extension settings: name -> (accepted types, how to write it).
EXTENSION = {
    "block_size": (int, "an integer"),
    "steps_per_block": (int, "an integer"),
    "policy": (str, "'threshold' or 'fixed'"),
    "threshold": ((int, float), "a number"),
    "confidence": (str, "'prob', 'margin' or 'entropy'"),
    "top_k": (int, "an integer"),
    "commit": (str, "'exact' or 'reuse'"),
    "ignore_eos": (bool, "true or false"),
    "stop_token_ids": (list, "a list of token ids"),
}
MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant")


class ApiError(CloverError):
    """A request the server refuses: HTTP `status`, OpenAI's error `type`, the offending `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}
        return {"error": err}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class TextRequest:
    """A chat or completion request, checked: the prompt (messages, text or ids), generation overrides."""

    kind: str  # "chat" | "completion"
    prompt: str | list[int] | list[dict]
    overrides: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # None: as many as the default allows and the context holds
    stream: bool = False
    include_usage: bool = False


@dataclass
class DecideRequest:
    context: str
    questions: dict[str, list[str]]
    mode: str = "joint"
    overrides: dict[str, Any] = field(default_factory=dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float)) and not isinstance(v, bool)


def _check_fields(body: Any, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - known - set(NEUTRAL) - set(IGNORED))
    if unknown:
        raise bad(f"unknown field '{unknown[0]}'; this endpoint takes {sorted(known)} (our own settings go in "
                  "the 'clover' object)", param=unknown[0], code="unknown_field")
    if "model" in body and not isinstance(body["model"], str):
        raise bad(f"'model' must be a string (any name: this server serves one model), got {body['model']!r}",
                  param="model", code="invalid_type")
    for name, allowed in NEUTRAL.items():
        if name in body and not any(body[name] is a if a is None else
                                    (type(body[name]) is type(a) and body[name] == a) for a in allowed):
            raise bad(f"'{name}' is not supported by this server (accepted only as {allowed[0]!r}); remove it",
                      param=name, code="unsupported_field")
    return body


def _typed(body: dict, name: str, check: Callable[[Any], bool], what: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise bad(f"'{name}' must be {what}, got {value!r}", param=name, code="invalid_type")
    return value


def _common(body: dict, fields: dict) -> tuple[dict, int | None, bool, bool]:
    """The sampling fields every text endpoint shares -> (overrides, max_tokens, stream, include_usage);
    `fields`: the model's `clover` settings."""
    overrides: dict[str, Any] = {}
    max_tokens = _typed(body, "max_tokens", _is_int, "an integer")
    if "max_completion_tokens" in body:
        mct = _typed(body, "max_completion_tokens", _is_int, "an integer")
        if max_tokens is not None and mct is not None and mct != max_tokens:
            raise bad("give max_tokens or max_completion_tokens, not both with different values", param="max_tokens")
        max_tokens = mct if mct is not None else max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    temperature = _typed(body, "temperature", _is_number, "a number")
    if temperature is not None:
        if not 0 <= temperature <= 2:
            raise bad(f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
        overrides["temperature"] = float(temperature)
    top_p = _typed(body, "top_p", _is_number, "a number")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise bad(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
        overrides["top_p"] = float(top_p)
    seed = _typed(body, "seed", _is_int, "an integer")
    if seed is not None:
        overrides["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad(f"'stop' must be a string or a list of strings, got {stop!r}", param="stop", code="invalid_type")
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise bad(f"'stop' takes 1 to {MAX_STOP} non-empty strings", param="stop")
        for s in stops:
            _valid_text(s, "stop")
        if stops:
            overrides["stop"] = tuple(stops)
    n = _typed(body, "n", _is_int, "an integer")
    if n is not None and n != 1:
        raise bad(f"'n' must be 1 (this server runs one generation per request), got {n}", param="n")
    stream = _typed(body, "stream", lambda v: isinstance(v, bool), "true or false") or False
    options = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = False
    if options is not None:
        extra = sorted(set(options) - {"include_usage"})
        if extra:
            raise bad(f"unknown field 'stream_options.{extra[0]}'; it takes include_usage", param="stream_options")
        include_usage = _typed(options, "include_usage", lambda v: isinstance(v, bool), "true or false") or False
    overrides.update(extension(body, fields))
    return overrides, max_tokens, stream, include_usage


def extension(body: dict, fields: dict = EXTENSION) -> dict:
    """The `clover` object: our own decoding settings (`fields`: name -> (types, how to write it); a block
    denoiser's are EXTENSION), each type-checked (values are checked by the engine)."""
    ext = body.get("clover")
    if ext is None:
        return {}
    if not isinstance(ext, dict):
        raise bad(f"'clover' must be an object of decoding settings, got {ext!r}", param="clover")
    out = {}
    for name, value in ext.items():
        if name not in fields:
            raise bad(f"unknown field 'clover.{name}'; it takes {sorted(fields)}", param=f"clover.{name}",
                      code="unknown_field")
        types, what = fields[name]
        ok = isinstance(value, types) and not (isinstance(value, bool) and types is not bool)
        if name == "stop_token_ids" and ok:
            ok = all(_is_int(t) for t in value)
        if not ok:
            raise bad(f"'clover.{name}' must be {what}, got {value!r}", param=f"clover.{name}", code="invalid_type")
        out[name] = tuple(value) if name == "stop_token_ids" else value
    return out


def _valid_text(text: str, param: str) -> str:
    """`text`, unless no tokenizer reads it (a lone UTF-16 surrogate: JSON's "\\ud800" escape)."""
    problem = not_text(text)
    if problem:
        raise bad(f"'{param}' holds a lone UTF-16 surrogate ({problem}); send valid Unicode", param=param,
                  code="invalid_text")
    return text


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _valid_text(content, f"{where}.content")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(_valid_text(part["text"], f"{where}.content[{k}].text"))
            elif kind in ("image_url", "input_image", "input_audio", "file"):
                raise bad(f"{where}.content[{k}] is {kind}: this model reads text only; send text parts",
                          param=f"{where}.content", code="unsupported_content")
            else:
                raise bad(f"{where}.content[{k}] must be {{\"type\": \"text\", \"text\": ...}}",
                          param=f"{where}.content", code="invalid_type")
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", param=f"{where}.content",
              code="invalid_type")


def chat_request(body: Any, fields: dict = EXTENSION) -> TextRequest:
    body = _check_fields(body, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                                "stop", "seed", "n", "stream", "stream_options", "clover"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with 'role' and 'content'", param=where, code="invalid_type")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"{where}.{extra[0]} is not supported (tool calls and the like are not); send role and "
                      "content", param=f"{where}.{extra[0]}", code="unknown_field")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role")
        # "developer" is OpenAI's newer name for the system message; the chat templates know "system".
        out.append({"role": "system" if role == "developer" else role, "content": _message_text(m.get("content"),
                                                                                                  where)})
    overrides, max_tokens, stream, usage = _common(body, fields)
    return TextRequest("chat", out, overrides, max_tokens, stream, usage)


def completion_request(body: Any, vocab_size: int, fields: dict = EXTENSION) -> TextRequest:
    body = _check_fields(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "n",
                                "stream", "stream_options", "clover"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} in 'prompt' is outside the vocabulary (size {vocab_size})",
                      param="prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                  param="prompt")
    else:
        _valid_text(prompt, "prompt")
    overrides, max_tokens, stream, usage = _common(body, fields)
    # Completions model a continuation of raw text: the default max_tokens is OpenAI's 16 there.
    return TextRequest("completion", prompt, overrides, max_tokens if max_tokens is not None else 16, stream, usage)


def decide_request(body: Any) -> DecideRequest:
    body = _check_fields(body, {"model", "context", "questions", "mode", "clover"})
    context = body.get("context")
    if not isinstance(context, str):
        raise bad("'context' must be a string (what the questions are about)", param="context")
    _valid_text(context, "context")
    questions = body.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise bad("'questions' must be an object mapping each name to its list of allowed answers, e.g. "
                  '{"window": ["open", "closed"]}', param="questions")
    for name, options in questions.items():  # their shapes are checked by the engine (runtime/decide.py)
        for text in [name, *(options if isinstance(options, list) else [options])]:
            if isinstance(text, str):
                _valid_text(text, "questions")
    mode = body.get("mode", "joint")
    if mode not in ("joint", "sequential"):
        raise bad(f"'mode' must be 'joint' or 'sequential', got {mode!r}", param="mode")
    overrides = extension(body)
    return DecideRequest(context, questions, mode, overrides)


@dataclass
class Prepared:
    """A text request ready for the worker: its prompt ids, its stop strings (the stream holds back what may
    start one), the model's run settings, and its max_tokens."""

    ids: list[int]
    stop: tuple[str, ...]
    settings: Any
    max_tokens: int


def context_exceeded(prompt_tokens: int, asked: int, limit: int, needed: int | None = None,
                     why: str = "") -> ApiError:
    """400 context_length_exceeded: the prompt and `asked` completion tokens (taking `needed` positions, when
    the model rounds them up) do not fit the model's context of `limit`."""
    needed = prompt_tokens + asked if needed is None else needed
    return ApiError(400, f"this request needs {prompt_tokens} prompt + {asked} completion tokens{why} = {needed} "
                         f"positions, over the model's context of {limit}; shorten the prompt or lower max_tokens",
                    param="max_tokens", code="context_length_exceeded",
                    extra={"limits": {"context": limit, "prompt_tokens": prompt_tokens, "max_tokens": asked}})
