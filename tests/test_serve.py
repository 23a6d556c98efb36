"""clover serve: a real server process on a loopback port, driven by the official `openai` client and by
raw HTTP. What it returns is checked against the same model run in this process through the Python API
(greedy decoding, or the same seed where sampling), on fresh random prompts."""

import http.client
import json
import random
import runpy
import shutil
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

import clover_lite
import clover_lite.runtime.engine
from clover_lite.cli.main import main as cli

from .seed import SEED

ServerProcess = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"),
                               run_name="serve_load")["ServerProcess"]


@pytest.fixture(scope="module")
def engine():
    return clover_lite.load()


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.stop() == 0, "".join(s.log)


def client(server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=60)


def open_stream(server, max_tokens: int, headers: dict | None = None):
    """A streamed completion that runs long (EOS ignored), its first chunk read: (connection, response)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    body = {"prompt": "sort: 3 1 2", "max_tokens": max_tokens, "stream": True, "clover": {"ignore_eos": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {**(headers or {}), "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return conn, resp


def digits(rng: random.Random) -> str:
    return " ".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 9)))


def test_chat_and_completion_match_the_engine(server, engine):
    rng = random.Random(SEED)
    c = client(server)
    for task in ("sort", "reverse", "add"):
        messages = [{"role": "user", "content": f"{task}: {digits(rng)}"}]
        n = rng.randint(4, 40)
        resp = c.chat.completions.create(model="clover-tiny", messages=messages, max_tokens=n)
        ref = engine.generate(messages, max_new_tokens=n)
        assert resp.choices[0].message.content == ref.text
        assert resp.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[ref.finish_reason]
        assert resp.usage.prompt_tokens == len(engine.encode_prompt(messages))
        assert resp.usage.completion_tokens == ref.stats.new_tokens
        assert resp.model_extra["clover"]["forwards"] == ref.stats.forwards
    # Completions continue raw text (no chat template), or token ids as given.
    prompt = f"sort: {digits(rng)}"
    resp = c.completions.create(model="clover-tiny", prompt=prompt, max_tokens=12)
    assert resp.choices[0].text == engine.generate(prompt, raw=True, max_new_tokens=12).text
    ids = engine.encode_prompt(prompt, raw=True)
    resp = c.completions.create(model="clover-tiny", prompt=ids, max_tokens=12)
    assert resp.choices[0].text == engine.generate(ids, max_new_tokens=12).text
    # Our decoding settings ride in the `clover` object.
    messages = [{"role": "user", "content": f"sort: {digits(rng)}"}]
    resp = c.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                     extra_body={"clover": {"policy": "fixed", "steps_per_block": 4}})
    ref = engine.generate(messages, max_new_tokens=16, policy="fixed", steps_per_block=4)
    assert resp.choices[0].message.content == ref.text and resp.model_extra["clover"]["forwards"] == ref.stats.forwards
    models = c.models.list()
    assert [m.id for m in models.data] == ["clover-tiny"]


def test_streaming_equals_the_full_reply_and_reports_usage(server, engine):
    rng = random.Random(SEED + 1)
    c = client(server)
    messages = [{"role": "user", "content": f"reverse: {digits(rng)}"}]
    chunks = list(c.chat.completions.create(model="m", messages=messages, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ref = engine.generate(messages, max_new_tokens=30)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.stats.new_tokens
    prompt = f"add: {digits(rng)}"
    pieces = list(c.completions.create(model="m", prompt=prompt, max_tokens=20, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == engine.generate(prompt, raw=True, max_new_tokens=20).text


def test_stop_strings_cut_the_reply_as_the_engine_does(server, engine):
    rng = random.Random(SEED + 2)
    c = client(server)
    prompt = f"sort: {digits(rng)} {digits(rng)}"
    full = engine.generate(prompt, raw=True, max_new_tokens=40, ignore_eos=True).text
    assert len(full) > 4
    cut = rng.randrange(1, len(full) - 2)
    stop = full[cut:cut + 2]  # a string the unstopped reply contains
    ref = engine.generate(prompt, raw=True, max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert ref.finish_reason == "stop" and stop not in ref.text
    for stream in (False, True):
        resp = c.completions.create(model="m", prompt=prompt, max_tokens=40, stop=[stop, "\x00never"], stream=stream,
                                    extra_body={"clover": {"ignore_eos": True}})
        text = "".join(p.choices[0].text for p in resp) if stream else resp.choices[0].text
        assert text == ref.text


def test_a_seed_makes_sampling_reproducible(server, engine):
    rng = random.Random(SEED + 3)
    c = client(server)
    messages = [{"role": "user", "content": f"sort: {digits(rng)}"}]
    seed = rng.randrange(1 << 20)
    kw = {"model": "m", "messages": messages, "max_tokens": 24, "temperature": 1.0, "seed": seed}
    a = c.chat.completions.create(**kw).choices[0].message.content
    b = c.chat.completions.create(**kw).choices[0].message.content
    assert a == b == engine.generate(messages, max_new_tokens=24, temperature=1.0, seed=seed).text


def test_joint_decisions_endpoint(server, engine):
    questions = {"window": ["open", "closed"], "ac": ["on", "off", "auto"]}
    context = f"cabin {random.Random(SEED).randint(10, 40)}C, raining"
    status, _, body = server.request("POST", "/v1/clover/decide", {"context": context, "questions": questions})
    assert status == 200, body
    got = json.loads(body)
    ref = engine.decide(context, questions)
    assert got["answers"] == ref.answers and got["order"] == ref.order and got["forwards"] == ref.forwards
    for name, probs in ref.probabilities.items():
        assert got["probabilities"][name] == pytest.approx(probs, rel=1e-5, abs=1e-9)
    assert got["confidence"] == pytest.approx(ref.confidence, rel=1e-5)
    status, _, body = server.request("POST", "/v1/clover/decide", {"context": "x", "questions": {"a": "yes"}})
    assert status == 400 and b"options must be a list" in body


BAD_REQUESTS = [
    # (path, body, status, words the message must hold)
    ("/v1/chat/completions", b'{"messages": [', 400, "malformed JSON"),
    ("/v1/chat/completions", b"\xff\xfe", 400, "not UTF-8"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temprature": 1}, 400,
     "unknown field 'temprature'"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400,
     "'max_tokens' must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "'temperature' must be a number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "'stop' must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "'n' must be 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400,
     "'logprobs' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "reads text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "clover": {"threshold": "x"}}, 400,
     "'clover.threshold' must be a number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "clover": {"speed": 1}}, 400,
     "unknown field 'clover.speed'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "clover": {"threshold": 7.0}}, 400,
     "threshold must be in"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "over the model's context"),
    ("/v1/completions", b'{"prompt": "sort: \\ud800 1"}', 400, "'prompt' holds a lone UTF-16 surrogate (U+D800"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "'messages[0].content' holds a lone UTF-16 surrogate"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["a\\udc80"]}', 400, "'stop' holds a lone UTF-16 surrogate"),
    ("/v1/clover/decide", b'{"context": "\\ud800", "questions": {"a": ["b", "c"]}}', 400,
     "'context' holds a lone UTF-16 surrogate"),
    ("/v1/completions", {"prompt": "hi", "model": 5}, 400, "'model' must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 3000}]}, 400,
     "fills the model's context of 2048 by itself"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "'prompt' must be a non-empty"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),
    ("/v1/completions", {"prompt": "hi", "seed": 10**25, "temperature": 0.7}, 400, "seed must fit in 64 bits"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e-38}, 400, "use 0 for greedy"),
    ("/v1/clover/decide", {"context": "x", "questions": {"window": ["a", "a"]}}, 400, "question 'window' lists"),
]


def test_bad_requests_get_one_clear_4xx_and_the_server_keeps_serving(server):
    for path, body, status, words in BAD_REQUESTS:
        got, _, raw = server.request("POST", path, body)
        assert got == status, (body, raw)
        err = json.loads(raw)["error"]
        assert words in err["message"], (body, err)
    got, _, raw = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 100000})
    assert json.loads(raw)["error"]["limits"]["context"] == 2048
    got, _, raw = server.request("POST", "/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert got == 413 and b"limit" in raw
    got, _, raw = server.request("GET", "/v1/nothing")
    assert got == 404 and b"endpoints" in raw
    got, _, _ = server.request("GET", "/v1/chat/completions")
    assert got == 405
    # The openai client sees them as its own exceptions, with our message.
    with pytest.raises(openai.BadRequestError, match="over the model's context"):
        client(server).completions.create(model="m", prompt="hi", max_tokens=100000)
    resp = client(server).completions.create(model="m", prompt="sort: 2 1", max_tokens=4)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert server.health()["failed"] == 0


def test_api_key_queue_limit_and_a_disconnect_mid_stream(tmp_path):
    """--max-queue 0: while one stream runs, another request gets 503 with Retry-After; a client leaving the
    stream frees the engine at its next step (the cancelled job decided fewer positions than it was asked).
    The model is the bundled one with a chat template that refuses system turns, as Qwen-style templates
    refuse some conversations: such a chat request is a 400 naming `messages` with the template's words."""
    model = tmp_path / "model"
    shutil.copytree(clover_lite.runtime.engine.BUNDLED_MODEL, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System turns are not supported') }}{% endif %}{% endfor %}"
                               + config["chat_template"])
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    server = ServerProcess(str(model), "--api-key", "sesame", "--max-queue", "0")
    try:
        status, _, raw = server.request("POST", "/v1/chat/completions", {"messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer sesame"})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "messages" and "System turns are not supported" in err["message"]
        assert server.request("GET", "/health")[0] == 200  # health needs no key
        assert server.request("GET", "/v1/models")[0] == 401
        with pytest.raises(openai.AuthenticationError):
            client(server, "wrong").models.list()
        auth = {"Authorization": "Bearer sesame"}
        conn, _ = open_stream(server, 1500, auth)
        status, headers, raw = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                                              headers=auth)
        assert status == 503 and int(headers["retry-after"]) >= 1 and b"busy" in raw
        conn.sock.close()
        conn.close()
        for _ in range(200):
            h = server.health()
            if h["cancelled"] == 1 and not h["busy"]:
                break
            time.sleep(0.05)
        assert h["cancelled"] == 1 and not h["busy"], h
        assert h["last_cancelled"]["committed_tokens"] < 1500
        resp = client(server, "sesame").completions.create(model="m", prompt="sort: 2 1", max_tokens=4)
        assert resp.usage.completion_tokens >= 1
    finally:
        assert server.stop() == 0, "".join(server.log)


def test_sigterm_drains_the_running_request_and_refuses_the_waiting_ones():
    server = ServerProcess("--max-queue", "4")
    try:
        _, resp = open_stream(server, 120)
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(r=server.request("POST", "/v1/completions",
                                                                            {"prompt": "hi", "max_tokens": 2})))
        t.start()
        for _ in range(200):
            if server.health()["waiting"] == 1:
                break
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        t.join(30)
        assert "data: [DONE]" in rest and '"finish_reason": "length"' in rest  # the running one finished
        assert waiting["r"][0] == 503 and b"shutting down" in waiting["r"][2]
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_serve_refuses_a_public_address_without_a_key():
    res = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert res.exit_code == 2 and "--api-key" in res.output


def test_load_benchmark_answers_or_refuses_every_request(tmp_path):
    out = tmp_path / "load.json"
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"),
                           run_name="bench")
    assert bench["main"](["--clients", "4", "--seconds", "4", "--max-queue", "1", "--max-requests", "40",
                          "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["lost"] == 0 and res["server_alive"] and res["server_exit_code"] == 0
    assert res["answered"] >= 1 and res["disconnects"] == 1
    s = res["server"]
    # Our count and the server's agree: the disconnect is among the answered (its stream had started).
    assert s["served"] + s["cancelled"] == res["answered"] and s["failed"] == 0
    assert s["refused"] == res["refused_503"]


def test_a_stop_past_the_drain_time_cancels_the_running_generation():
    server = ServerProcess("--drain", "0.5")
    try:
        _, resp = open_stream(server, 1800)
        server.proc.send_signal(signal.SIGINT)
        try:
            rest = resp.read().decode()
        except http.client.IncompleteRead as e:  # the cancelled stream's chunked body ends unfinished
            rest = e.partial.decode()
        # Cut, not finished (1800 positions take far longer than the drain): an error event ends the stream.
        assert '"code": "shutting_down"' in rest and rest.endswith("data: [DONE]\n\n"), rest[-300:]
        assert '"finish_reason": "length"' not in rest
        assert server.proc.wait(60) == 0
        cancelled = [line for line in server.log if "cancelled (client gone or server stopping)" in line]
        assert len(cancelled) == 1 and "of 1800 positions" in cancelled[0], "".join(server.log)
        assert "Traceback" not in "".join(server.log)
    finally:
        server.stop()


def test_a_whole_reply_still_running_past_the_drain_time_gets_a_503():
    server = ServerProcess("--drain", "0.5")
    try:
        got = {}
        body = {"prompt": "sort: 3 1 2", "max_tokens": 1800, "clover": {"ignore_eos": True}}
        t = threading.Thread(target=lambda: got.update(r=server.request("POST", "/v1/completions", body)))
        t.start()
        deadline = time.monotonic() + 30
        while json.loads(server.request("GET", "/health")[2])["busy"] is False and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        t.join(60)
        status, _, raw = got["r"]
        assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down", raw
        assert server.proc.wait(60) == 0 and "Traceback" not in "".join(server.log), "".join(server.log)
    finally:
        server.stop()
