"""OpenAI-shaped response bodies and stream chunks, plus our statistics under `clover`."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from clover_lite.runtime.generation import Generation

# Our finish reasons -> OpenAI's: an end-of-sequence token and a stop string both end the reply naturally.
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


ID_PREFIX = {"chat": "chatcmpl", "completion": "cmpl", "decide": "decide"}


def new_id(kind: str) -> str:
    return f"{ID_PREFIX[kind]}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Reply:
    """A text endpoint's answer, whichever model made it: the text, OpenAI's counts, and the model's own
    decoding statistics (sent under `clover`, with the queue time added)."""

    text: str
    finish_reason: str  # ours: "eos" | "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    statistics: dict


def reply_of(gen: Generation) -> Reply:
    """A block denoiser's Generation as a Reply."""
    s = gen.stats
    stats = {"forwards": s.forwards, "commit_forwards": s.commit_forwards, "blocks": s.blocks,
             "tokens_per_forward": round(s.tokens_per_forward, 4), "committed_tokens": s.committed_tokens,
             "prefill_seconds": round(s.prefill_seconds, 4), "seconds": round(s.seconds, 4),
             "tokens_per_second": round(s.tokens_per_second, 2)}
    return Reply(gen.text, gen.finish_reason, s.prompt_tokens, s.new_tokens, stats)


def statistics(reply: Reply, queue_seconds: float) -> dict:
    """The decoding statistics a response carries beside `usage`."""
    return {**reply.statistics, "queue_seconds": round(queue_seconds, 4), "finish_reason": reply.finish_reason}


def full_response(kind: str, rid: str, model: str, reply: Reply, queue_seconds: float) -> dict:
    finish = FINISH[reply.finish_reason]
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": reply.text}, "finish_reason": finish,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": reply.text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(reply.prompt_tokens, reply.completion_tokens),
            "clover": statistics(reply, queue_seconds)}


class ChunkWriter:
    """Server-sent events for one streamed request, in OpenAI's chunk format."""

    def __init__(self, kind: str, rid: str, model: str):
        self.kind, self.rid, self.model = kind, rid, model
        self.created = int(time.time())

    def _event(self, obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              extra: dict | None = None) -> str:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return self._event({"id": self.rid, "object": self._object, "created": self.created, "model": self.model,
                            "choices": [choice], **(extra or {})})

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def finish(self, reply: Reply, queue_seconds: float, include_usage: bool) -> str:
        # Our statistics ride on the chunk that carries the finish reason (clients keep unknown fields).
        out = self.chunk(finish=FINISH[reply.finish_reason], extra={"clover": statistics(reply, queue_seconds)})
        if include_usage:  # OpenAI's usage chunk: no choices, sent only when asked for
            out += self._event({"id": self.rid, "object": self._object, "created": self.created, "model": self.model,
                                "choices": [], "usage": usage(reply.prompt_tokens, reply.completion_tokens)})
        return out + "data: [DONE]\n\n"

    def error(self, body: dict) -> str:
        return self._event(body) + "data: [DONE]\n\n"
