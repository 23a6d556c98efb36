"""Probes: OpenAI request fields -> GenerationConfig overrides; usage totals; the default max_tokens bounded by
the room the prompt leaves."""
import json

import pytest

import clover_lite
from clover_lite.serve.requests import chat_request, completion_request

from .test_serve import ServerProcess

MSG = [{"role": "user", "content": "hi"}]


def test_sampling_fields_map_onto_the_overrides():
    req = chat_request({"messages": MSG, "temperature": 0, "top_p": 0.5, "seed": 0, "stop": ["ab", "cd"]})
    assert req.overrides == {"temperature": 0.0, "top_p": 0.5, "seed": 0, "stop": ("ab", "cd")}
    assert chat_request({"messages": MSG, "stop": "x"}).overrides == {"stop": ("x",)}


def test_max_tokens_fields():
    assert chat_request({"messages": MSG, "max_completion_tokens": 7}).max_tokens == 7
    assert chat_request({"messages": MSG, "max_tokens": 5, "max_completion_tokens": 5}).max_tokens == 5
    assert chat_request({"messages": MSG}).max_tokens is None
    assert completion_request({"prompt": "hi"}, 256).max_tokens == 16  # OpenAI's completions default
    assert completion_request({"prompt": "hi", "max_tokens": 3}, 256).max_tokens == 3


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_usage_totals_and_default_max_tokens_fit_the_room(server):
    engine = clover_lite.load()
    limit = engine.context_limit
    base = len(engine.encode_prompt([{"role": "user", "content": ""}]))
    content = "1 " * ((limit - base - 5) // 2)  # leaves a few positions, fewer than the default max_new_tokens
    messages = [{"role": "user", "content": content}]
    P = len(engine.encode_prompt(messages))
    assert limit - P < engine.default_config.max_new_tokens
    status, _, raw = server.request("POST", "/v1/chat/completions", {"messages": messages,
                                                                     "clover": {"ignore_eos": True}})
    assert status == 200, raw
    u = json.loads(raw)["usage"]
    assert u["prompt_tokens"] == P and 1 <= u["completion_tokens"] <= limit - P
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
