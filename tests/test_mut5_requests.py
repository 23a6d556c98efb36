"""Mutation round 5: OpenAI request bodies checked into prompts and settings, each rule against its documented
bounds (OpenAI's ranges, the module's own limits) on hand-written bodies."""

import pytest

from clover_lite.serve.requests import MAX_STOP, ApiError, chat_request, completion_request

MSG = [{"role": "user", "content": "hi"}]


def refused(fn, body, param, words, *args):
    with pytest.raises(ApiError) as e:
        fn(body, *args)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


@pytest.mark.parametrize("field, value", [("frequency_penalty", False), ("logprobs", 0), ("best_of", True),
                                          ("top_logprobs", False), ("echo", 0)])
def test_a_neutral_field_of_the_wrong_json_type_is_refused(field, value):
    """The neutral values are matched with their JSON type: false is not the number 0, nor 1 true (Python's
    False == 0 and True == 1 must not let them through); the same fields at their neutral value are accepted."""
    refused(chat_request, {"messages": MSG, field: value}, field, "is not supported by this server")
    neutral = {"frequency_penalty": 0, "logprobs": False, "best_of": 1, "top_logprobs": 0, "echo": False}[field]
    assert chat_request({"messages": MSG, field: neutral}).overrides == {}


def test_max_tokens_and_max_completion_tokens_must_agree():
    """Both given with different values is one error on max_tokens; equal values are one limit."""
    refused(chat_request, {"messages": MSG, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens",
            "not both with different values")
    assert chat_request({"messages": MSG, "max_tokens": 6, "max_completion_tokens": 6}).max_tokens == 6
    assert chat_request({"messages": MSG, "max_tokens": 4, "max_completion_tokens": None}).max_tokens == 4


def test_max_tokens_must_be_at_least_one():
    """max_tokens (or max_completion_tokens) of 0 or below is refused; 1 is the smallest accepted."""
    for body in ({"max_tokens": 0}, {"max_completion_tokens": 0}, {"max_tokens": -3}):
        refused(chat_request, {"messages": MSG, **body}, "max_tokens", "must be at least 1")
    assert chat_request({"messages": MSG, "max_tokens": 1}).max_tokens == 1
    refused(completion_request, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "must be at least 1", 256)


def test_temperature_and_top_p_ranges():
    """temperature in [0, 2] (OpenAI's range) and top_p in (0, 1]: the ends inside are accepted as floats, just
    outside is refused naming the field."""
    assert chat_request({"messages": MSG, "temperature": 2, "top_p": 1}).overrides == {"temperature": 2.0,
                                                                                       "top_p": 1.0}
    assert chat_request({"messages": MSG, "temperature": 0, "top_p": 1e-9}).overrides == {"temperature": 0.0,
                                                                                          "top_p": 1e-9}
    for t in (2.0001, -0.5):
        refused(chat_request, {"messages": MSG, "temperature": t}, "temperature", "must be in [0, 2]")
    for p in (0, 0.0, 1.5, -1):
        refused(chat_request, {"messages": MSG, "top_p": p}, "top_p", "must be in (0, 1]")


def test_stop_takes_at_most_max_stop_strings():
    """Up to MAX_STOP (16) stop strings are accepted, in order; one more is refused."""
    stops = [f"s{i}" for i in range(MAX_STOP + 1)]
    assert chat_request({"messages": MSG, "stop": stops[:MAX_STOP]}).overrides["stop"] == tuple(stops[:MAX_STOP])
    refused(chat_request, {"messages": MSG, "stop": stops}, "stop", f"takes 1 to {MAX_STOP} non-empty strings")
    refused(chat_request, {"messages": MSG, "stop": ["a", ""]}, "stop", "non-empty strings")


@pytest.mark.parametrize("name", ["block_size", "steps_per_block", "top_k", "threshold"])
def test_a_json_boolean_is_not_a_number_in_the_clover_settings(name):
    """true for a numeric clover setting is refused (Python's bool is an int, JSON's is not); ignore_eos takes
    one, and a number of the right type passes through."""
    refused(chat_request, {"messages": MSG, "clover": {name: True}}, f"clover.{name}", "must be")
    assert chat_request({"messages": MSG, "clover": {name: 4}}).overrides == {name: 4}
    assert chat_request({"messages": MSG, "clover": {"ignore_eos": True}}).overrides == {"ignore_eos": True}


def test_developer_messages_are_system_messages():
    """OpenAI's 'developer' role reaches the chat template as 'system'; the other roles pass unchanged."""
    req = chat_request({"messages": [{"role": "developer", "content": "be brief"}, *MSG,
                                     {"role": "assistant", "content": "ok"}, {"role": "system", "content": "s"}]})
    assert [m["role"] for m in req.prompt] == ["system", "user", "assistant", "system"]
    assert req.prompt[0]["content"] == "be brief"


def test_a_completion_batch_of_one_is_its_prompt():
    """prompt ["text"] or [[ids]] (a batch of one) is the same request as "text" or [ids]."""
    assert completion_request({"prompt": ["hello"]}, 256).prompt == "hello"
    assert completion_request({"prompt": [[5, 6, 7]]}, 256).prompt == [5, 6, 7]
    refused(completion_request, {"prompt": ["a", "b"]}, "prompt", "one prompt per request", 256)


def test_prompt_token_ids_must_be_inside_the_vocabulary():
    """Ids 0..vocab_size-1 are accepted; vocab_size itself and negatives are refused naming the id."""
    assert completion_request({"prompt": [0, 255]}, 256).prompt == [0, 255]
    refused(completion_request, {"prompt": [3, 256]}, "prompt", "token id 256 in 'prompt' is outside", 256)
    refused(completion_request, {"prompt": [-1]}, "prompt", "token id -1", 256)
