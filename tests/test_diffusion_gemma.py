"""DiffusionGemma (text path) against transformers 5.24's implementation, which nobody here wrote.

Each reference model is built by transformers from a tiny random config, perturbed so no weight, norm, router
scale or layer scalar sits at its init, saved with save_pretrained (safetensors) and loaded through our loader.
Logits are compared in fp32; generations token for token. Generation samples (multinomial draws, random canvas
and renoising), so it is made deterministic by seeding: transformers draws from torch's default CPU generator
after torch.manual_seed(seed), ours from torch.Generator().manual_seed(seed), the same Mersenne-Twister stream,
and both loops make the same draws in the same order.
"""

import json

import pytest
import torch

from clover_lite.checkpoint.diffusion_gemma_weights import load_diffusion_gemma
from clover_lite.checkpoint.tiny_diffusion_gemma import special_id, write_tiny_diffusion_gemma
from clover_lite.errors import CheckpointError, GenerationError
from clover_lite.runtime.diffusion_gemma_loop import (
    CanvasEvent,
    DiffusionGemmaSettings,
    Session,
    StepEvent,
    generate,
    settings_from_generation_config,
    stream,
)

from .seed import SEED

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.diffusion_gemma")

VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8)
BASE = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, global_head_dim=16, num_global_key_value_heads=1, num_experts=4, top_k_experts=2,
            moe_intermediate_size=16, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
# Layer-type patterns: sliding + global (window shorter than the prompts), global only, alternating with MHA
# keys/values, a different RoPE and every expert routed, and an untied checkpoint (encoder stored apart).
CONFIGS = {
    "sliding_global": dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           sliding_window=4),
    "global_only": dict(layer_types=["full_attention", "full_attention"], top_k_experts=1,
                        num_global_key_value_heads=2),
    "alternating_all_experts": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], sliding_window=3,
        num_key_value_heads=4, num_global_key_value_heads=4, top_k_experts=4, final_logit_softcapping=5.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 5000.0}}),
    "untied": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5, tie=False),
}


def reference(path, name, seed=0, canvas=8, peak=1.0):
    """A random transformers DiffusionGemma saved at `path`; `peak` scales the (tied) embedding, sharpening
    the output distributions so that several tokens are accepted per step and adaptive stopping triggers."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = {**BASE, **CONFIGS[name]}
    tie = text.pop("tie", True)
    text["num_hidden_layers"] = len(text["layer_types"])
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=VISION, canvas_length=canvas,
                               tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):  # differ between encoder and decoder
                b.copy_(torch.empty(b.shape).uniform_(0.5, 1.5, generator=gen))
        model.model.decoder.embed_tokens.weight.mul_(peak)
        if not tie:
            model.model.encoder.language_model.embed_tokens.weight.mul_(peak)
    model.save_pretrained(path)
    return model


def softcapped(hf, hidden):
    cap = hf.final_logit_softcapping
    return torch.tanh(hf.lm_head(hidden).float() / cap) * cap


def close(a, b, what, tol=1e-4):
    assert a.shape == b.shape, what
    err = (a - b).abs().max().item()
    assert err < tol, f"{what}: max abs diff {err}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    """Encoder states and logits; decoder logits without and with self-conditioning, before and after a
    finished canvas is appended to the prefix; ragged prompt lengths, some beyond the sliding window."""
    from transformers.cache_utils import DynamicCache

    hf = reference(tmp_path, name, seed=len(name))
    ours, report = load_diffusion_gemma(tmp_path)
    assert report.skipped and all("vision" in n for n in report.skipped)
    if name == "alternating_all_experts":
        assert ours.config.final_logit_softcapping == hf.final_logit_softcapping == 5.0
    V, C = ours.config.vocab_size, 8
    gen = torch.Generator().manual_seed(7)
    for L in (1, 4, 9, 23):
        ids = torch.randint(0, V, (2, L), generator=gen)
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        prefix = ours.new_cache()
        with torch.no_grad():
            ref_h = hf.model.encoder(input_ids=ids, cache=cache).last_hidden_state
            h = ours.encode(ids, prefix)
            close(h, ref_h, f"L={L} encoder states")
            close(ours.logits(h), softcapped(hf, ref_h), f"L={L} encoder logits")
            for canvas_no in range(2):
                canvas = torch.randint(0, V, (2, C), generator=gen)
                ref = hf(decoder_input_ids=canvas, cache=cache).logits
                close(ours.denoise(canvas, prefix), ref, f"L={L} canvas {canvas_no} first step")
                sc = 3 * torch.randn(2, C, V, generator=gen)
                ref = hf(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc).logits
                close(ours.denoise(canvas, prefix, sc), ref, f"L={L} canvas {canvas_no} self-conditioned")
                # the canvas is committed: appended to both prefixes by the encoder
                ref_h = hf.model.encoder(input_ids=canvas, cache=cache).last_hidden_state
                close(ours.encode(canvas, prefix), ref_h, f"L={L} canvas {canvas_no} appended")
        assert prefix.length == cache.get_seq_length() == L + 2 * C


def test_chunked_prefill_matches_transformers(tmp_path, monkeypatch):
    """A long prompt is encoded in chunks (exact for a causal encoder); chunk edges inside and across the
    sliding window give transformers' one-pass states and the same decoder logits."""
    from transformers.cache_utils import DynamicCache

    import clover_lite.models.diffusion_gemma as dg

    hf = reference(tmp_path, "sliding_global", seed=9)
    ours, _ = load_diffusion_gemma(tmp_path)
    monkeypatch.setattr(dg, "PREFILL_CHUNK", 5)
    gen = torch.Generator().manual_seed(1)
    ids, canvas = torch.randint(0, 80, (1, 23), generator=gen), torch.randint(0, 80, (1, 8), generator=gen)
    cache, prefix = DynamicCache(config=hf.config.get_text_config(decoder=True)), ours.new_cache()
    with torch.no_grad():
        close(ours.encode(ids, prefix), hf.model.encoder(input_ids=ids, cache=cache).last_hidden_state, "states")
        close(ours.denoise(canvas, prefix), hf(decoder_input_ids=canvas, cache=cache).logits, "decoder logits")


@pytest.mark.parametrize("window", [8, 300])
def test_prompt_chunks_follow_the_window_and_equal_one_pass_in_float64(tmp_path, window):
    """A prompt is encoded in chunks of the sliding window (256 at least, PREFILL_CHUNK at most): in float64
    the hidden states and every layer's cached keys and values equal one pass over the whole prompt."""
    from clover_lite.models.diffusion_gemma import PREFILL_CHUNK, encode_chunk

    path = write_tiny_diffusion_gemma(tmp_path / "m", seed=window, sliding_window=window, num_hidden_layers=2,
                                      layer_types=["sliding_attention", "full_attention"],
                                      max_position_embeddings=2048)
    model, _ = load_diffusion_gemma(path, dtype=torch.float64)
    chunk = encode_chunk(model.config)
    assert chunk == min(PREFILL_CHUNK, max(256, window))
    ids = torch.randint(0, 80, (1, 2 * chunk + 37))  # two whole chunks and a ragged one
    calls = []
    real = model._encode_chunk
    model._encode_chunk = lambda part, cache: calls.append(part.shape[1]) or real(part, cache)
    chunked, whole = model.new_cache(), model.new_cache()
    with torch.no_grad():
        h = model.encode(ids, chunked)
        ref = real(ids, whole)
    assert calls == [chunk, chunk, 37]
    torch.testing.assert_close(h, ref, rtol=0, atol=1e-12)
    for i in range(2):
        torch.testing.assert_close(chunked.keys[i], whole.keys[i], rtol=0, atol=1e-12)
        torch.testing.assert_close(chunked.values[i], whole.values[i], rtol=0, atol=1e-12)
    assert chunked.length == whole.length == ids.shape[1]


def test_nonfinite_logits_stop_generation(tmp_path):
    from clover_lite.errors import NonFiniteError

    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=1)
    model, _ = load_diffusion_gemma(path)
    with torch.no_grad():
        model.decoder.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="canvas 1, step 1"):
        generate(model, [special_id("<bos>"), 104, 105], max_new_tokens=8)


def test_nonfinite_weights_are_refused_at_load(tmp_path):
    """A NaN in a random stored weight: load refuses it naming the tensor and its file, as for the block
    denoisers; check_finite=False loads it (the report says the scan was skipped) and generation stops with
    NonFiniteError, whose advice fits the fp32 model (not "use float32")."""
    from safetensors.torch import load_file, save_file

    import clover_lite
    from clover_lite.errors import NonFiniteError

    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=3)
    (file,) = sorted(path.glob("*.safetensors"))
    tensors = load_file(file)
    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    # Not an expert's weights (one may go unrouted) nor an embedding (a row may go unread).
    names = sorted(n for n, t in tensors.items() if t.is_floating_point() and not any(
        k in n for k in ("embed", "experts", "per_expert_scale")))
    name = names[int(torch.randint(0, len(names), (), generator=rng))]
    flat = tensors[name].flatten().clone()
    flat[int(torch.randint(0, flat.numel(), (), generator=rng))] = float("nan")
    tensors[name] = flat.view_as(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in .*holds 1 NaN"):
        clover_lite.load(path, device="cpu")
    # Unscanned, a NaN must reach the logits for generation to stop: not so for every tensor above (the
    # encoder's last layer_scalar feeds nothing the decoder reads; torch's CPU attention without a mask turns
    # NaN queries into finite outputs), so this part puts it in the decoder's final norm, which every logit reads.
    tensors = load_file(file)
    norm = tensors["model.decoder.norm.weight"].clone()
    norm[int(torch.randint(0, norm.numel(), (), generator=rng))] = float("nan")
    tensors["model.decoder.norm.weight"] = norm
    save_file(tensors, file, metadata={"format": "pt"})
    engine = clover_lite.load(path, device="cpu", check_finite=False)
    assert any("scan of the weights was skipped" in n for n in engine.load_report.notes)
    with pytest.raises(NonFiniteError, match="check its weights"):
        engine.generate([special_id("<bos>"), 104, 105], max_new_tokens=8, seed=0)


def _hf_tokens(out, prompt_len, eos=()):
    toks = out.sequences[0, prompt_len:].tolist()
    for i, t in enumerate(toks):
        if t in eos:
            return toks[: i + 1]
    return toks


@pytest.mark.parametrize("name,peak,bound,stability,confidence", [
    ("alternating_all_experts", 1.0, 0.1, 1, 0.005),  # defaults: one token accepted per step, every step run
    ("sliding_global", 8.0, 1.0, 2, 0.5),  # peaked: several tokens accepted per step
    ("global_only", 8.0, 1.0, 0, 0.3),  # and adaptive stopping ends canvases early
])
def test_generation_matches_transformers(tmp_path, name, peak, bound, stability, confidence):
    """Seeded sampling (see the module docstring): four canvases after ragged prompts, token for token; the
    prefix is encoded once and each finished canvas appended once (nothing re-encoded per canvas)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    hf = reference(tmp_path, name, seed=3, peak=peak)
    ours, _ = load_diffusion_gemma(tmp_path)
    encoded = []
    real_encode = ours.encode
    ours.encode = lambda ids, cache: (encoded.append(ids.shape[1]), real_encode(ids, cache))[1]
    kw = dict(max_new_tokens=32, max_denoising_steps=10, stability_threshold=stability,
              confidence_threshold=confidence)
    sampler = dict(entropy_bound=bound)
    hf_kw = dict(sampler_config=EntropyBoundSamplerConfig(**sampler), **kw)
    gen = torch.Generator().manual_seed(11)
    early, most_accepted = 0, 0
    for seed, L in enumerate((1, 6, 19)):
        prompt = torch.randint(3, ours.config.vocab_size, (1, L), generator=gen)
        torch.manual_seed(seed)
        ref = hf.generate(prompt, **hf_kw)
        encoded.clear()
        events = list(stream(ours, prompt[0].tolist(), DiffusionGemmaSettings(**sampler, **kw),
                             generator=torch.Generator().manual_seed(seed)))
        result = events[-1].result
        assert result.tokens == _hf_tokens(ref, L), f"prompt of {L}"
        assert encoded == [L, 8, 8, 8] and result.encoded_tokens == L + 24
        steps = [e.steps for e in events if isinstance(e, CanvasEvent)]
        assert len(steps) == 4 and sum(steps) == result.steps
        assert len([e for e in events if isinstance(e, StepEvent)]) == result.steps
        early += sum(s < 10 for s in steps)
        most_accepted = max(most_accepted, *(e.accepted for e in events if isinstance(e, StepEvent)))
    assert (most_accepted > 1) == (peak > 1)
    assert (early > 0) == (peak > 1)  # adaptive stopping was exercised where the model is confident


def test_sampler_pieces_match_transformers():
    """Acceptance, stopping and the temperature schedule against transformers' classes, on random logits with
    repeats injected so the stability branch is taken (a random model's argmax canvas never repeats)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
        EntropyBoundSamplerConfig,
        LinearTemperatureScheduleLogitsProcessor,
        StableAndConfidentStoppingCriteria,
    )

    from clover_lite.runtime.diffusion_gemma_loop import AdaptiveStop, _accept, _entropy, temperature

    gen = torch.Generator().manual_seed(0)
    for bound in (0.1, 1.0, 5.0):
        logits = torch.randn(1, 16, 50, generator=gen) * torch.rand(1, 16, 1, generator=gen) * 12
        sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), 16, 50, 4)
        sampler.accept_canvas(torch.zeros(1, 16, dtype=torch.long), torch.ones(1, 16, dtype=torch.long), logits, 1)
        assert torch.equal(_accept(_entropy(logits), bound), sampler.accepted_token_mask)
    schedule = LinearTemperatureScheduleLogitsProcessor(0.3, 0.9, 7)
    for step in range(7, 0, -1):
        x = torch.randn(2, 5, generator=gen)
        assert torch.equal(x / temperature(0.3, 0.9, step, 7),
                           schedule(None, x, cur_step=torch.tensor(step, dtype=torch.int32)))
    for stability in (0, 1, 2, 3):
        ref, ours = StableAndConfidentStoppingCriteria(stability, 1.5), AdaptiveStop(stability, 1.5)
        canvases = [torch.randint(0, 3, (1, 4), generator=gen) for _ in range(6)]
        decisions = []
        for i in range(40):
            argmax = canvases[i // 5 % 6] if i % 11 else canvases[i % 6]
            logits = torch.randn(1, 4, 6, generator=gen) * (4 if i % 2 else 0.5)
            want = bool(ref(argmax, logits)[0])
            assert ours(argmax, _entropy(logits)) == want, f"stability {stability}, step {i}"
            decisions.append(want)
        assert any(decisions) and not all(decisions)


def test_generation_eos_and_prefix_reuse(tmp_path):
    """An EOS ends the generation inside a canvas (transformers pads after it; we cut); a follow-up call with a
    Session encodes only the new tokens and matches transformers continuing from its returned cache."""
    hf = reference(tmp_path, "sliding_global", seed=5, peak=8.0)
    ours, _ = load_diffusion_gemma(tmp_path)
    prompt = [2, 17, 33, 45, 9, 61, 70]
    kw = dict(max_new_tokens=24, max_denoising_steps=8, stability_threshold=1, confidence_threshold=0.5)
    torch.manual_seed(0)
    free = hf.generate(torch.tensor([prompt]), **kw).sequences[0, len(prompt):].tolist()
    eos = free[8 + 3]  # a token of the second canvas, made the EOS; earlier occurrences end sooner
    torch.manual_seed(0)
    ref = hf.generate(torch.tensor([prompt]), eos_token_id=eos, pad_token_id=0, **kw)
    result = generate(ours, prompt, DiffusionGemmaSettings(eos_token_ids=(eos,), **kw),
                      generator=torch.Generator().manual_seed(0))
    assert result.finish_reason == "eos" and result.tokens[-1] == eos
    assert result.tokens == _hf_tokens(ref, len(prompt), (eos,))

    # Two turns without EOS: transformers gets the uncached tail (its last canvas) plus the new turn.
    session = Session()
    torch.manual_seed(1)
    first = hf.generate(torch.tensor([prompt]), **kw)
    ours_first = generate(ours, prompt, DiffusionGemmaSettings(**kw), session=session,
                          generator=torch.Generator().manual_seed(1))
    assert ours_first.tokens == first.sequences[0, len(prompt):].tolist()
    turn = [5, 6, 7]
    cached = first.cache.get_seq_length()
    tail = first.sequences[:, cached:]
    torch.manual_seed(2)
    second = hf.generate(torch.cat([tail, torch.tensor([turn])], 1), cache=first.cache, **kw)
    history = prompt + ours_first.tokens + turn
    ours_second = generate(ours, history, DiffusionGemmaSettings(**kw), session=session,
                           generator=torch.Generator().manual_seed(2))
    assert ours_second.encoded_tokens == tail.shape[1] + len(turn) + 16  # the new tail, then two canvases
    assert ours_second.tokens == second.sequences[0, tail.shape[1] + len(turn):].tolist()
    kept = list(session.tokens)
    with pytest.raises(GenerationError, match="image input"):  # a refused request leaves the cache as it was
        generate(ours, history, DiffusionGemmaSettings(**kw), session=session, images=["cat.png"])
    assert session.tokens == kept and session.cache.length == len(kept)


def test_tiny_checkpoint_loads_in_transformers(tmp_path):
    """Our tiny writer's layout is transformers': it loads there and generates the same tokens, with the
    settings read from its generation_config.json."""
    from transformers import DiffusionGemmaForBlockDiffusion

    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=4)
    ours, _ = load_diffusion_gemma(path)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    settings = settings_from_generation_config(path, max_new_tokens=24)
    assert settings.max_denoising_steps == 8 and settings.eos_token_ids == (257, 261)
    prompt = [special_id("<bos>"), special_id("<start_of_turn>"), 117, 115, 101, 114, 10, 104, 105]
    torch.manual_seed(9)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24)
    result = generate(ours, prompt, settings, generator=torch.Generator().manual_seed(9))
    assert result.tokens == _hf_tokens(ref, len(prompt), settings.eos_token_ids)


def test_clear_errors(tmp_path):
    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=1, max_position_embeddings=64)
    model, _ = load_diffusion_gemma(path)
    prompt = [special_id("<bos>"), 104, 105]
    with pytest.raises(GenerationError, match="image input is not supported"):
        generate(model, prompt, images=[torch.zeros(3, 16, 16)])
    with pytest.raises(GenerationError, match="image placeholder"):
        generate(model, [*prompt, special_id("<image_soft_token>")], max_new_tokens=8)
    with pytest.raises(GenerationError, match="larger than the context"):
        generate(model, prompt, canvas_length=128, max_new_tokens=8)
    with pytest.raises(GenerationError, match="over the context of 64"):
        generate(model, prompt, max_new_tokens=64)  # 3 + 8 canvases of 8 > 64 positions
    with pytest.raises(GenerationError, match="sampler='top_k' is unknown"):
        generate(model, prompt, sampler="top_k")
    for setting, words in ((dict(eos_token_ids=None), "eos_token_ids=None must be a list of integer"),
                           (dict(stability_threshold=1.5), "stability_threshold=1.5 must be a whole number"),
                           (dict(t_min=None), "t_min=None must be a finite number")):
        with pytest.raises(GenerationError, match=words):
            generate(model, prompt, **setting)
    gen_cfg = path / "generation_config.json"
    raw = json.loads(gen_cfg.read_text())
    raw["sampler_config"] = {"_cls_name": "MaskGITSamplerConfig", "temperature": 1.0}
    gen_cfg.write_text(json.dumps(raw))
    with pytest.raises(GenerationError, match="sampler_config .* is unknown"):
        settings_from_generation_config(path)


def test_loader_names_missing_and_unexpected_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=2)
    file = path / "model.safetensors"
    tensors = load_file(file)
    missing = "model.decoder.layers.1.router.per_expert_scale"
    save_file({k: v for k, v in tensors.items() if k != missing}, file)
    with pytest.raises(CheckpointError, match=f"missing .*{missing}"):
        load_diffusion_gemma(path)
    save_file({**tensors, "model.decoder.layers.9.mlp.up_proj.weight": torch.zeros(2)}, file)
    with pytest.raises(CheckpointError, match="unexpected .*layers.9.mlp.up_proj"):
        load_diffusion_gemma(path)
    shaped = dict(tensors)
    shaped["model.decoder.norm.weight"] = torch.ones(3)
    save_file(shaped, file)
    with pytest.raises(CheckpointError, match="model.decoder.norm.weight.*shape"):
        load_diffusion_gemma(path)


def test_engine_text_stream_and_session(tmp_path):
    """The engine wraps tokenizer, generation_config.json settings and a session: its reply is the loop's, a
    streamed draft decodes each step, and a follow-up turn reuses the conversation's prefix cache."""
    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine, DiffusionGemmaReply, TextEvent

    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=6)
    engine = DiffusionGemmaEngine.load(path)
    ids = engine.encode_prompt("hi")
    assert ids[:2] == [special_id("<bos>"), special_id("<start_of_turn>")]  # the chat template was applied
    events = list(engine.stream("hi", seed=3, max_new_tokens=16))
    reply = events[-1]
    assert isinstance(reply, DiffusionGemmaReply)
    loop = generate(engine.model, ids, engine.settings, generator=torch.Generator().manual_seed(3),
                    max_new_tokens=16)
    assert reply.tokens == loop.tokens and reply.text == engine.decode(loop.tokens)
    steps = [e for e in events if isinstance(e, TextEvent) and isinstance(e.event, StepEvent)]
    assert steps and all(e.draft == engine.decode(e.event.draft) for e in steps)
    done: list[int] = []
    for e in events[:-1]:  # the committed text: every canvas finished so far, decoded whole
        if isinstance(e.event, CanvasEvent):
            done += e.event.tokens
        assert e.committed == engine.decode(done)
    assert reply.text == events[-2].committed
    follow = [*ids, *reply.result.tokens, *engine.encode_prompt("again", raw=True)]
    second = engine.generate(follow, seed=4, max_new_tokens=16)
    assert second.result.encoded_tokens < len(follow)  # only the uncached tail was encoded
    with pytest.raises(GenerationError, match="unknown DiffusionGemma setting"):
        engine.generate("hi", temperature=0.0)


def test_engine_runs_one_generation_at_a_time(tmp_path):
    """The session's prefix cache is shared, so the engine is held as Engine is: a paused stream makes a
    second caller in its thread an error and one in another thread wait (EngineBusyError past `wait`), and
    threads generating at once each get what they get alone."""
    import threading

    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine
    from clover_lite.runtime.exclusive import EngineBusyError

    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=7)
    engine = DiffusionGemmaEngine.load(path)
    prompts = ["one two three", "four five six seven"]
    alone = [DiffusionGemmaEngine.load(path).generate(p, seed=k, max_new_tokens=24).tokens
             for k, p in enumerate(prompts)]
    paused = engine.stream(prompts[0], seed=0, max_new_tokens=24)
    next(paused)
    with pytest.raises(GenerationError, match="already generating in this thread"):
        engine.generate("zzz", seed=9, max_new_tokens=8)
    got: dict = {}

    def other() -> None:
        try:
            engine.generate("zzz", seed=9, max_new_tokens=8, wait=0.2)
        except EngineBusyError as e:
            got["error"] = e

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert "busy" in str(got["error"])
    assert [e for e in paused][-1].tokens == alone[0]  # the held stream went on undisturbed
    out: dict = {}
    threads = [threading.Thread(target=lambda k=k, p=p: out.update({k: engine.generate(p, seed=k,
                                                                                      max_new_tokens=24).tokens}))
               for k, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [out[0], out[1]] == alone


def test_bfloat16_load_tracks_float32(tmp_path):
    path = write_tiny_diffusion_gemma(tmp_path / "tiny", seed=8)
    f32, _ = load_diffusion_gemma(path)
    b16, _ = load_diffusion_gemma(path, dtype=torch.bfloat16)
    assert b16.decoder.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.tensor([[258, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]])
    canvas = torch.randint(0, 265, (1, 8), generator=torch.Generator().manual_seed(SEED))
    outs = []
    for m in (f32, b16):
        cache = m.new_cache()
        m.encode(ids, cache)
        outs.append(m.denoise(canvas, cache))
    # KL per position, not the largest logit difference: over 300 random canvases that reached 0.84 (logits
    # up to 2.2) while the KL stayed at most 0.04.
    lp, lq = outs[0].log_softmax(-1), outs[1].log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert outs[1].dtype == torch.float32 and float(kl.max()) < 0.1, (SEED, kl)


def test_benchmark_runs_and_tokens_identical(tmp_path):
    import runpy
    from pathlib import Path

    out = tmp_path / "bench.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "diffusion_gemma.py"
    main = runpy.run_path(str(bench), run_name="bench")["main"]
    assert main(["--prompt-lengths", "5", "40", "--canvases", "2", "--canvas-length", "8", "--steps", "3",
                 "--hidden", "32", "--layers", "2", "--vocab", "300", "--sliding-window", "16",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["prompt_tokens"] for r in rows] == [5, 40]
    assert all(r["identical_tokens"] and r["new_tokens"] == 16 for r in rows)


# ---- through clover_lite.load and the command line ---------------------------------------------------------
def test_load_and_clover_run_serve_diffusion_gemma_and_other_commands_refuse_it(tmp_path):
    """`clover tiny --family diffusion_gemma` writes one; clover_lite.load gives its engine; `clover run` prints
    what that engine generates with the same seed; `clover info` plans it; options that do not apply, and
    commands that do not run it yet, each give one clear error."""
    from click.testing import CliRunner

    import clover_lite
    from clover_lite.cli.main import main as cli
    from clover_lite.errors import CloverError
    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine

    out = tmp_path / "dg"
    r = CliRunner().invoke(cli, ["tiny", str(out), "--family", "diffusion_gemma", "--seed", "4"])
    assert r.exit_code == 0, r.output
    engine = clover_lite.load(out, device="cpu")
    assert isinstance(engine, DiffusionGemmaEngine)
    seed = int(torch.randint(0, 10_000, ()))
    want = engine.generate("hello", seed=seed, max_new_tokens=16).text
    r = CliRunner().invoke(cli, ["run", str(out), "hello", "-n", "16", "--seed", str(seed), "--no-stats"])
    assert r.exit_code == 0, r.output
    assert r.stdout == want + "\n"
    r = CliRunner().invoke(cli, ["run", str(out), "hello", "--threshold", "0.5"])
    assert r.exit_code == 2 and "--threshold does not apply to DiffusionGemma" in r.output
    r = CliRunner().invoke(cli, ["decide", str(out), "-c", "x", "-q", "a=b,c"])  # serve runs it (test_serve_...)
    assert r.exit_code == 1 and "DiffusionGemma checkpoint" in r.output and "clover run" in r.output, r.output
    r = CliRunner().invoke(cli, ["info", str(out)])  # reads it now (tests/test_diffusion_gemma_int4.py)
    assert r.exit_code == 0 and "diffusion_gemma" in r.output and "prefix cache" in r.output, r.output
    with pytest.raises(CloverError, match="context does not apply"):
        clover_lite.load(out, device="cpu", context=64)


def test_chat_turns_reuse_the_prefix_and_equal_fresh_generations(tmp_path):
    """`clover chat` on DiffusionGemma (the session and loop it runs, on a plain view): each turn's reply equals
    a fresh engine's `generate` on the whole conversation with the same seed, though the chat's engine keeps
    its prefix cache from turn to turn; /set changes the sampler's settings and refuses bad ones."""
    import io

    import clover_lite
    from clover_lite.cli.chat import PlainView
    from clover_lite.cli.chat_canvas import CanvasChatLoop, CanvasChatSession

    path = write_tiny_diffusion_gemma(tmp_path / "dg", seed=int(torch.randint(0, 1000, ())))
    engine = clover_lite.load(path, device="cpu")
    seed = int(torch.randint(0, 10_000, ()))
    session = CanvasChatSession(engine, seed=seed, max_new_tokens=16)
    lines = iter(["hello there", "/set steps 5", "/set t_min 2", "and again?"])

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out, err = io.StringIO(), io.StringIO()
    assert CanvasChatLoop(session, read, PlainView(out, err)).run() == 0
    assert "max_denoising_steps = 5" in out.getvalue() and "t_min" in err.getvalue()
    msgs = session.messages
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    assert [msgs[i]["content"] for i in users] == ["hello there", "and again?"], msgs
    for i, settings in zip(users, ({}, {"max_denoising_steps": 5}), strict=True):
        fresh = clover_lite.load(path, device="cpu")
        want = fresh.generate(msgs[: i + 1], seed=seed, max_new_tokens=16, **settings).text
        # An empty reply (the model's first token its end) is not recorded: the next message is the user's.
        got = msgs[i + 1]["content"] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else ""
        assert got == want, (i, out.getvalue(), err.getvalue())

