"""clover serve on a DiffusionGemma checkpoint: a real server process driven by the official `openai` client,
and the app in this process for the request checks. References: the same checkpoint run here through the
Python API with the same seed, its tokens cut to max_tokens and decoded by the tokenizer, and stop strings
found in that text with str.find; a byte-level decode for the hand-worked canvas cuts. Prompts and seeds are
fresh per run (tests/seed.py)."""

import json
import random
import runpy
from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient

import clover_lite
from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma
from clover_lite.serve.app import ServeSettings, create_app
from clover_lite.serve.diffusion_gemma_text import take_canvas
from clover_lite.tokenizer.incremental import IncrementalDecoder

from .seed import SEED

ServerProcess = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"),
                               run_name="serve_load")["ServerProcess"]
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("dgserve") / "dg", seed=SEED % 1000)


@pytest.fixture(scope="module")
def engine(model_dir):
    return clover_lite.load(model_dir, device="cpu")


@pytest.fixture(scope="module")
def app_client(engine):
    with TestClient(create_app(engine, ServeSettings(model_id="dg"))) as c:
        yield c


def reference(engine, prompt, n: int, seed: int, raw: bool = False, **settings):
    """(text, completion tokens, our finish reason) the server must return: the API's reply cut to n tokens."""
    engine.session.reset()
    r = engine.generate(prompt, raw=raw, seed=seed, max_new_tokens=n, **settings)
    tokens = r.tokens[:n]
    finish = r.finish_reason if len(r.tokens) <= n else "length"
    return engine.tokenizer.decode(tokens, skip_special_tokens=True), tokens, finish, r


def words(rng: random.Random) -> str:
    return " ".join(rng.choice(["canvas", "noise", "denoise", "token", "block", "entropy"])
                    for _ in range(rng.randint(1, 6)))


def test_the_server_process_answers_as_the_api_does(model_dir, engine):
    """`clover serve DIR` on DiffusionGemma: chat and completions (streamed or not) equal the API's reply with
    the same seed, cut to max_tokens (ragged against the canvas), with OpenAI's usage and finish reasons."""
    rng = random.Random(SEED)
    server = ServerProcess(str(model_dir))
    try:
        c = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        for _ in range(3):
            messages = [{"role": "user", "content": words(rng)}]
            n, seed = rng.randint(1, 21), rng.randrange(1 << 30)
            text, tokens, finish, r = reference(engine, messages, n, seed)
            resp = c.chat.completions.create(model="dg", messages=messages, max_tokens=n, seed=seed)
            assert resp.choices[0].message.content == text, (SEED, n, seed)
            assert resp.choices[0].finish_reason == FINISH[finish]
            assert resp.usage.prompt_tokens == len(engine.encode_prompt(messages))
            assert resp.usage.completion_tokens == len(tokens) <= n
            assert resp.model_extra["clover"]["forwards"] == r.result.steps
            assert resp.model_extra["clover"]["canvases"] == r.result.canvases
        prompt, n, seed = words(rng), rng.randint(9, 30), rng.randrange(1 << 30)
        text, tokens, finish, _ = reference(engine, prompt, n, seed, raw=True)
        chunks = list(c.completions.create(model="dg", prompt=prompt, max_tokens=n, seed=seed, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
            [FINISH[finish]]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
        card = c.models.list().data[0]
        assert card.id == "dg" and card.model_extra["clover"]["model_type"] == "diffusion_gemma"
        with pytest.raises(openai.BadRequestError, match="does not apply to DiffusionGemma"):
            c.chat.completions.create(model="dg", messages=[{"role": "user", "content": "hi"}], temperature=0.7)
    finally:
        assert server.stop() == 0, "".join(server.log)


def test_stop_strings_cut_the_reply_at_their_start(app_client, engine):
    """A stop string the unstopped reply contains (drawn from it) ends the reply where it starts; the usage
    counts the tokens that cover what is left; streamed text equals it and never shows the stop string."""
    rng = random.Random(SEED + 1)
    checked = 0
    for _ in range(20):
        if checked == 3:
            break
        prompt, seed = words(rng), rng.randrange(1 << 30)
        full, _, _, _ = reference(engine, prompt, 40, seed, raw=True, stability_threshold=None)
        # A stop string drawn from the reply, without U+FFFD (a random model's bytes are often not UTF-8, and a
        # canvas ending inside a character shows one there until the next canvas completes it).
        starts = [i for i in range(1, len(full) - 2) if "\ufffd" not in full[i:i + 2]]
        if not starts:
            continue
        at = rng.choice(starts)
        stop = full[at:at + rng.randint(1, 2)]
        want = full[: full.find(stop)]
        ids = engine.encode_prompt(prompt, raw=True)
        engine.session.reset()
        tokens = engine.generate(ids, seed=seed, max_new_tokens=40, stability_threshold=None).tokens
        covering = min(k for k in range(len(tokens) + 1)
                       if engine.tokenizer.decode(tokens[:k], skip_special_tokens=True).startswith(want))
        body = {"prompt": prompt, "max_tokens": 40, "seed": seed, "stop": [stop, "\x00never"],
                "clover": {"stability_threshold": None}}
        got = app_client.post("/v1/completions", json=body).json()
        assert got["choices"][0]["text"] == want and got["choices"][0]["finish_reason"] == "stop", (SEED, stop)
        assert got["usage"]["completion_tokens"] == covering
        with app_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        pieces = [e["choices"][0]["text"] for e in events]
        assert "".join(pieces) == want and not any(stop in p for p in pieces)
        checked += 1
    assert checked, SEED  # replies too short to hold a stop string every time: look at the model's EOS odds


def test_sampler_settings_ride_in_the_clover_object(app_client, engine):
    rng = random.Random(SEED + 2)
    prompt, seed, steps = words(rng), rng.randrange(1 << 30), rng.randint(1, 3)
    settings = {"max_denoising_steps": steps, "t_min": 0.1, "t_max": 1.5, "entropy_bound": 0.5}
    text, tokens, _, r = reference(engine, prompt, 16, seed, raw=True, **settings)
    got = app_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "seed": seed,
                                                   "clover": settings}).json()
    assert got["choices"][0]["text"] == text and got["clover"]["forwards"] == r.result.steps <= steps * 2


BAD = [
    ({"top_p": 0.5}, "'top_p' does not apply to DiffusionGemma", "top_p"),
    ({"temperature": 0}, "'temperature' does not apply to DiffusionGemma", "temperature"),
    ({"clover": {"ignore_eos": True}}, "unknown field 'clover.ignore_eos'", "clover.ignore_eos"),
    ({"clover": {"t_min": 0.9, "t_max": 0.5}}, "need 0 <= t_min < t_max", "clover"),
    ({"clover": {"max_denoising_steps": 0}}, "max_denoising_steps=0 must be a positive integer", "clover"),
    ({"clover": {"entropy_bound": "x"}}, "'clover.entropy_bound' must be a number", "clover.entropy_bound"),
    ({"max_tokens": 4090}, "(in canvases of 8)", "max_tokens"),
    ({"seed": 10**25}, "seed must fit in 64 bits", "seed"),
    ({"clover": {"max_denoising_steps": 2**31}}, "must be at most 2147483647", "clover"),
    ({"clover": {"t_min": 0, "t_max": 1e-38}}, "t_max=1e-38 must be between 0.0001 and 1e+30", "clover"),
    ({"clover": {"t_max": 1e39}}, "t_max=1e+39 must be between", "clover"),
    ({"prompt": "look: <image_soft_token>"}, "image placeholder token(s)", "prompt"),
    ({"prompt": [263]}, "image placeholder token(s) [263]", "prompt"),
]


@pytest.mark.parametrize("extra,words_,param", BAD)
def test_bad_requests_name_the_field(app_client, extra, words_, param):
    """Refused before they queue: the server's counts show no job for them."""
    before = app_client.get("/health").json()
    r = app_client.post("/v1/completions", json={"prompt": "abc", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words_ in err["message"] and err["param"] == param, err
    after = app_client.get("/health").json()
    assert [after[k] - before[k] for k in ("served", "failed", "cancelled")] == [0, 0, 0]


def test_an_unexpected_failure_is_one_json_500_and_the_server_goes_on(app_client, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("a bug here")

    monkeypatch.setattr(engine, "encode_prompt", broken)
    r = app_client.post("/v1/completions", json={"prompt": "abc"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    assert "TypeError: a bug" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert app_client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200


def test_context_counts_whole_canvases_and_decisions_are_refused(app_client, engine):
    """A reply takes whole canvases of the context: 4096 - P rounded down to canvases is the most max_tokens;
    /v1/clover/decide is refused naming the endpoints that serve this model."""
    P = len(engine.encode_prompt("abc", raw=True))
    room = (engine.context_limit - P) // 8 * 8
    assert app_client.post("/v1/completions", json={"prompt": "abc", "max_tokens": room + 1}).status_code == 400
    limits = app_client.post("/v1/completions", json={"prompt": "abc", "max_tokens": room + 1}).json()["error"]
    assert limits["limits"] == {"context": engine.context_limit, "prompt_tokens": P, "max_tokens": room + 1}
    r = app_client.post("/v1/completions", json={"prompt": "abc", "max_tokens": room,
                                                 "clover": {"max_denoising_steps": 1, "stability_threshold": None}})
    assert r.status_code == 200, r.text
    for body in ({"context": "x", "questions": {"a": ["b", "c"]}}, {}):  # refused whatever the body holds
        r = app_client.post("/v1/clover/decide", json=body)
        assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"], r.text


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", "replace")


@pytest.mark.parametrize("trial", range(20))
def test_take_canvas_against_a_whole_decode(trial):
    """Canvases of random bytes (multi-byte characters cut across canvases included), a ragged max_tokens and
    a stop string: the reply is decode(all tokens up to max_tokens) cut at the first stop, its tokens the
    fewest whose decode starts with it; the reason is stop, else length when max_tokens cut a canvas."""
    rng = random.Random(SEED * 31 + trial)
    C = rng.randint(1, 6)
    alphabet = list(b"ab") + list("é€".encode())
    canvases = [[rng.choice(alphabet) for _ in range(C)] for _ in range(rng.randint(1, 5))]
    max_tokens = rng.randint(1, C * len(canvases))
    flat = [t for c in canvases for t in c][:max_tokens]
    want = byte_decode(flat)
    clean = [i for i, ch in enumerate(want) if ch != "\ufffd"]
    at = rng.choice(clean) if clean and trial % 4 else None  # a stop string the reply holds, or one it doesn't
    stop = (want[at : at + rng.randint(1, 2)].replace("\ufffd", "") if at is not None else "zz",)
    want_reason = None
    if (i := want.find(stop[0])) >= 0:
        want_reason, want = "stop", want[:i]
    tokens, detok = [], IncrementalDecoder(byte_decode, windowed=False)
    for canvas in canvases:
        finish, text = take_canvas(canvas, tokens, detok, max_tokens, stop)
        if finish is not None:
            break
    if want_reason is None and max_tokens < C * len(canvases):  # a canvas cut, or one left with no room
        want_reason = "length"
    assert text == want and finish == want_reason, (canvases, max_tokens, stop)
    k = min(k for k in range(len(flat) + 1) if byte_decode(flat[:k]).startswith(want))
    assert tokens == (flat[:k] if finish == "stop" else flat)


def test_a_chat_without_max_tokens_gets_the_whole_canvases_the_context_leaves(tmp_path):
    """No max_tokens: the reply may take as many whole canvases as fit after the prompt (a 64-position model,
    prompts of ragged lengths); a prompt that leaves less than one canvas is refused as over the context."""
    path = write_tiny_diffusion_gemma(tmp_path / "dg64", seed=SEED % 997, max_position_embeddings=64)
    small = clover_lite.load(path, device="cpu")
    rng = random.Random(SEED + 4)
    with TestClient(create_app(small, ServeSettings(model_id="s"))) as c:
        for length in (rng.randint(1, 20), rng.randint(21, 33), 64):
            messages = [{"role": "user", "content": "".join(rng.choice("abcdef ") for _ in range(length))}]
            P = len(small.encode_prompt(messages))
            room = (64 - P) // 8 * 8
            r = c.post("/v1/chat/completions", json={"messages": messages, "clover": {"max_denoising_steps": 1}})
            if room <= 0:  # the prompt is what is too long: no max_tokens was sent
                err = r.json()["error"]
                assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
                assert err["param"] == "messages" and "leaves no room for one canvas of 8" in err["message"]
                continue
            assert r.status_code == 200, (P, r.text)
            assert r.json()["usage"]["completion_tokens"] <= min(room, small.settings.max_new_tokens)
