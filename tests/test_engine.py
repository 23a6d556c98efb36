"""The Python API: load, generate, stream, prompts of every kind, thread-safety and its errors."""

import shutil
import threading

import pytest
import torch

import clover_lite
from clover_lite import BlockEvent, DoneEvent, GenerationConfig, GenerationError, StepEvent
from clover_lite.errors import CloverError

from . import hf_models


def test_generate_text_messages_and_ids(tiny_engine):
    e = tiny_engine
    out = e.generate("Hello", max_new_tokens=9)
    assert len(out.token_ids) == 9 and out.finish_reason in ("length", "eos")
    assert out.text == e.decode(out.token_ids)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = e.encode_prompt(msgs)
    rendered = e.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n") and ids == e.tokenizer.encode(rendered)
    assert e.generate(msgs, max_new_tokens=6).token_ids == e.generate(ids, max_new_tokens=6).token_ids
    s = out.stats
    assert s.forwards >= 1 and s.committed_tokens >= len(out.token_ids) and s.seconds > 0
    assert s.tokens_per_forward == s.committed_tokens / s.forwards


def test_stream_events(tiny_engine):
    events = list(tiny_engine.stream([1, 2, 3, 4, 5], max_new_tokens=11, block_size=4, ignore_eos=True))
    steps = [ev for ev in events if isinstance(ev, StepEvent)]
    blocks = [ev for ev in events if isinstance(ev, BlockEvent)]
    assert isinstance(events[-1], DoneEvent)
    out = events[-1].generation
    # Every generated position is committed exactly once, by some step.
    committed = sorted(p for ev in steps for p in ev.committed)
    assert committed == list(range(5, 16))
    assert [b.block_start for b in blocks] == [4, 8, 12]
    assert blocks[0].tokens[0] == 5  # the prompt's tail is part of the first block
    assert steps[-1].text == out.text and blocks[-1].text == out.text
    assert all(None not in b.tokens for b in blocks)


def test_one_generation_at_a_time(tiny_engine):
    model = tiny_engine.model
    active, peak = [0], [0]
    original = model.step

    def counting_step(*a, **k):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        try:
            return original(*a, **k)
        finally:
            active[0] -= 1

    model.step = counting_step
    try:
        expected = tiny_engine.generate([7, 8, 9], max_new_tokens=8).token_ids
        results = [None] * 4

        def worker(i):
            results[i] = tiny_engine.generate([7, 8, 9], max_new_tokens=8).token_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        del model.step
    assert results == [expected] * 4 and peak[0] == 1


def test_nested_generation_in_same_thread_is_an_error(tiny_engine):
    stream = tiny_engine.stream([1, 2], max_new_tokens=4)
    next(stream)
    with pytest.raises(GenerationError, match="already generating"):
        tiny_engine.generate([1, 2], max_new_tokens=2)
    stream.close()
    assert len(tiny_engine.generate([1, 2], max_new_tokens=2).token_ids) == 2  # released


def test_a_busy_engine_is_waited_for_at_most_wait_seconds(tiny_engine):
    from clover_lite.runtime.exclusive import EngineBusyError

    stream = tiny_engine.stream([1, 2], max_new_tokens=8)
    next(stream)  # another caller's stream holds the engine
    result = {}

    def other():
        try:
            tiny_engine.generate([3, 4], max_new_tokens=2, wait=0.3)
        except EngineBusyError as e:
            result["error"] = e

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert "busy" in str(result["error"]) and "wait=" in str(result["error"])
    list(stream)  # the first stream is unaffected
    assert len(tiny_engine.generate([3, 4], max_new_tokens=2, wait=0).token_ids) == 2


def test_an_abandoned_stream_releases_the_engine(tiny_engine):
    expected = tiny_engine.generate([3, 4], max_new_tokens=4).token_ids
    tiny_engine.abandon_after = 0.3
    try:
        left_open = tiny_engine.stream([1, 2], max_new_tokens=8)
        next(left_open)  # advanced once, then forgotten (but still referenced)
        got = {}
        t = threading.Thread(target=lambda: got.update(out=tiny_engine.generate([3, 4], max_new_tokens=4, wait=10)))
        t.start()
        t.join(30)
        assert got["out"].token_ids == expected  # taken over after 0.3 s, and the cache was the waiter's alone
        with pytest.raises(GenerationError, match="left unadvanced"):
            next(left_open)
        dropped = tiny_engine.stream([1, 2], max_new_tokens=8)
        next(dropped)
        del dropped  # a dropped stream releases at once: no wait needed
        assert tiny_engine.generate([3, 4], max_new_tokens=4, wait=0).token_ids == expected
    finally:
        tiny_engine.abandon_after = 60


def test_a_computing_stream_is_never_taken_over():
    from clover_lite.runtime.exclusive import EngineBusyError, OneAtATime

    turns = OneAtATime(abandon_after=0.01)
    turn = turns.acquire()
    turns.advancing(turn)  # computing a step, however long it takes
    done = {}
    t = threading.Thread(target=lambda: done.update(r=pytest.raises(EngineBusyError, turns.acquire, 0.2)))
    t.start()
    t.join(10)
    assert done["r"] and not turn.taken_over
    turns.paused(turn)  # now it waits for its caller: idle time counts
    threading.Event().wait(0.05)
    t = threading.Thread(target=lambda: done.update(second=turns.acquire(1.0)))
    t.start()
    t.join(10)
    assert turn.taken_over and done["second"] is not turn


def test_a_string_prompt_is_a_user_message_unless_raw(tiny_engine):
    e = tiny_engine
    text = "sort: 5 3 9 1"
    message = [{"role": "user", "content": text}]
    assert e.tokenizer.has_chat_template
    assert e.encode_prompt(text) == e.encode_prompt(message)
    assert e.encode_prompt(text, raw=True) == e.tokenizer.encode(text)
    assert e.generate(text, max_new_tokens=6).token_ids == e.generate(message, max_new_tokens=6).token_ids
    raw = e.generate(text, max_new_tokens=6, raw=True).token_ids
    assert raw == e.generate(e.tokenizer.encode(text), max_new_tokens=6).token_ids


def test_prompt_errors(tiny_engine):
    with pytest.raises(GenerationError, match="context"):
        tiny_engine.generate([1] * 8000, max_new_tokens=500)
    with pytest.raises(GenerationError, match="empty"):
        tiny_engine.generate([], max_new_tokens=2)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        tiny_engine.generate([1, 99999], max_new_tokens=2)
    for bad in ([1.5, 2], None, 5, b"hi"):  # bytes would otherwise read as token ids
        with pytest.raises(GenerationError, match="prompt must be"):
            tiny_engine.generate(bad, max_new_tokens=2)
    with pytest.raises(GenerationError, match="unknown generation setting"):
        tiny_engine.generate("x", max_tokens=3)


def test_context_given_at_load_limits_generations_and_chat(tiny_dir, tiny_engine):
    """load(context=N) (`--context`): without a fixed cache (CPU) the engine still keeps to N positions, and
    a chat trims its replies to what is left of them, as it must on a GPU, where the cache is sized once."""
    from clover_lite.cli.chat import ChatSession

    limit = tiny_engine.config.max_position_embeddings
    assert tiny_engine.context_limit == limit
    # What fits in free memory sizes a static step's fixed cache only: an eager engine's cache grows.
    assert clover_lite.Engine(tiny_engine.model, None, static_context=40).context_limit == limit
    eng = clover_lite.load(tiny_dir, device="cpu", context=40)
    assert eng.context_limit == 40
    with pytest.raises(GenerationError, match=rf"exceeds the context of 40 tokens \(this engine's; the model's is "
                                              rf"{limit}: load with a longer context, --context N"):
        eng.generate([1] * 30, max_new_tokens=11)
    with pytest.raises(GenerationError, match=rf"exceeds the context of {limit} tokens; shorten"):
        tiny_engine.generate([1] * limit, max_new_tokens=1)
    with pytest.raises(CloverError, match=r"static step needs a context of at least one block \(4 positions\)"):
        clover_lite.Engine(tiny_engine.model, None, context=3, static_step=True)
    with pytest.raises(CloverError, match=r"context must be 1 to \d+ positions \(the model.s limit\), got 0"):
        clover_lite.Engine(tiny_engine.model, None, context=0)
    with pytest.raises(CloverError, match=rf"context must be 1 to {limit} positions"):
        clover_lite.load(tiny_dir, device="cpu", context=limit + 1)  # refused before planning memory for it
    assert len(eng.generate([1] * 30, max_new_tokens=10, ignore_eos=True).token_ids) == 10
    ids, cfg = ChatSession(eng, GenerationConfig(max_new_tokens=1000)).request("hi")
    assert cfg.max_new_tokens == 40 - len(ids)


def test_checkpoint_without_mask_token_or_tokenizer(tmp_path):
    hf_models.qwen3_5_moe_causal(tmp_path, seed=3)
    engine = clover_lite.load(tmp_path, device="cpu")
    assert engine.tokenizer is None and engine.mask_token_id is None
    with pytest.raises(GenerationError, match="mask token"):
        engine.generate([1, 2, 3], max_new_tokens=2)
    with pytest.raises(GenerationError, match="no tokenizer"):
        engine.generate("text", max_new_tokens=2)
    engine = clover_lite.load(tmp_path, device="cpu", mask_token_id=95)
    out = engine.generate([1, 2, 3], max_new_tokens=5, block_size=2)
    assert len(out.token_ids) == 5 and 95 not in out.token_ids


def test_load_errors(tmp_path, tiny_dir):
    with pytest.raises(CloverError, match="no such model directory"):
        clover_lite.load(tmp_path / "nope")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(CloverError, match="expected a model directory"):
        clover_lite.load(f)
    with pytest.raises(CloverError, match="dtype"):
        clover_lite.load(tiny_dir, dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(CloverError, match="CUDA is not available"):
            clover_lite.load(tiny_dir, device="cuda")
    for device in ("tpu", "meta", 3.5):
        with pytest.raises(CloverError, match="clover-lite runs on 'cpu' or 'cuda'"):
            clover_lite.load(tiny_dir, device=device)
    with pytest.raises(CloverError, match="kernels='cuda': use one of auto, torch, triton"):
        clover_lite.load(tiny_dir, kernels="cuda")
    with pytest.raises(CloverError, match="mask_token_id 100000 is outside the vocabulary"):
        clover_lite.load(tiny_dir, mask_token_id=100_000)
    if not torch.cuda.is_available():  # the default backend on a CPU is torch: no static step to run
        with pytest.raises(CloverError, match="static_step=True: .*needs the Triton backend"):
            clover_lite.load(tiny_dir, device="cpu", static_step=True)
    d = tmp_path / "config_is_a_folder"
    shutil.copytree(tiny_dir, d)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(CloverError, match="config.json: not a file"):
        clover_lite.load(d)


def test_a_cuda_device_the_machine_lacks_is_named(monkeypatch):
    from clover_lite.runtime.engine import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(CloverError, match=r"'cuda:2' requested but this machine has 2 CUDA devices \(cuda:0 to"):
        resolve_device("cuda:2")


def test_reference_forward_is_engine_model(tiny_engine):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        logits = tiny_engine.model(ids, block_size=4)
    assert logits.shape == (1, 6, tiny_engine.config.vocab_size) and logits.dtype == torch.float32


def test_a_model_that_barely_fits_the_ram_is_loaded_with_a_note(tiny_dir, monkeypatch):
    from clover_lite.planning import devices
    from clover_lite.planning.planner import LOAD_CHECK_CONTEXT, plan

    need = plan(tiny_dir, None, LOAD_CHECK_CONTEXT, "cpu", dtype="fp32").total
    monkeypatch.setattr(devices, "available_ram", lambda: int(need * 1.1))
    notes = clover_lite.load(tiny_dir, device="cpu").load_report.notes
    assert any(n.startswith("memory: this needs about") for n in notes), notes
    monkeypatch.setattr(devices, "available_ram", lambda: need * 10)
    assert not any(n.startswith("memory:") for n in clover_lite.load(tiny_dir, device="cpu").load_report.notes)
