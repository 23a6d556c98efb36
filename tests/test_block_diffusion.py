"""Block-diffusion semantics: the cached path equals the reference forward at every step, the mask is
bidirectional inside a block and causal across blocks, steps never change the cache."""

import pytest
import torch

from clover_lite.runtime.generation import CachedRunner, GenerationConfig, RecomputeRunner, denoise, run_to_end


class Recorder:
    """Wraps a runner and keeps the logits of every step."""

    def __init__(self, runner):
        self.runner, self.logits, self.device = runner, [], runner.device

    def reserve(self, n):
        self.runner.reserve(n)

    def prefill(self, ids):
        self.runner.prefill(ids)

    def step(self, block, positions):
        out = self.runner.step(block, positions)
        self.logits.append(out.clone())
        return out

    def commit(self, block):
        return self.runner.commit(block)


@pytest.mark.parametrize("block_size", [1, 4, 32])
@pytest.mark.parametrize("prompt_len", [1, 6, 37])
@pytest.mark.parametrize("policy", ["threshold", "fixed"])
def test_cached_equals_reference_every_step(tiny_engine, block_size, prompt_len, policy):
    model = tiny_engine.model
    gen = torch.Generator().manual_seed(block_size * 100 + prompt_len)
    prompt = torch.randint(0, 256, (prompt_len,), generator=gen).tolist()
    # A low threshold / two steps per block make several positions commit in one step.
    cfg = GenerationConfig(
        max_new_tokens=45, block_size=block_size, policy=policy, threshold=0.006,
        steps_per_block=max(1, block_size // 2),
    ).resolved(None)
    mask = tiny_engine.mask_token_id
    cached = Recorder(CachedRunner(model, block_size))
    ref = Recorder(RecomputeRunner(model, block_size))
    a = run_to_end(denoise(cached, prompt, cfg, mask))
    b = run_to_end(denoise(ref, prompt, cfg, mask))
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == 45
    assert len(cached.logits) == len(ref.logits) == a.stats.forwards
    for x, y in zip(cached.logits, ref.logits, strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)
    if block_size > 1:
        assert a.stats.tokens_per_forward > 1.0  # the test exercised multi-token steps


def test_mask_is_bidirectional_inside_blocks_and_causal_across(tiny_engine):
    model = tiny_engine.model
    gen = torch.Generator().manual_seed(11)
    B = 4
    ids = torch.randint(0, 256, (1, 14), generator=gen)
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 256  # position 10 is in block [8, 12)
    with torch.no_grad():
        a = model(ids, block_size=B)
        b = model(changed, block_size=B)
        causal_a = model(ids, block_size=1)
        causal_b = model(changed, block_size=1)
    # Earlier positions of the same block see position 10...
    for p in (8, 9):
        assert (a[0, p] - b[0, p]).abs().max() > 1e-3
    # ...committed (earlier) blocks never do.
    torch.testing.assert_close(a[0, :8], b[0, :8], atol=1e-5, rtol=0)
    # With block size 1 it is the causal LM: nothing before 10 changes.
    torch.testing.assert_close(causal_a[0, :10], causal_b[0, :10], atol=1e-5, rtol=0)
    assert (a[0, 8] - causal_a[0, 8]).abs().max() > 1e-4



def test_forward_logits_where_selects_positions(tiny_engine):
    """`where` (the evaluation's masked positions): the lm_head runs on those rows only, same logits."""
    model = tiny_engine.model
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (3, 13), generator=gen)
    where = torch.rand(3, 13, generator=gen) < 0.3
    where[1] = False  # a window with no selected position
    with torch.no_grad():
        full = model(ids, block_size=4)
        part = model(ids, block_size=4, where=where)
    assert part.shape == (int(where.sum()), full.shape[-1])
    torch.testing.assert_close(part, full[where], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="where must be a bool tensor of shape"):
        model(ids, block_size=4, where=where.long())

def _cache_state(cache):
    out = []
    for store in (cache.keys, cache.values):
        out += [t[:, :, : cache.length].clone() for t in store if t is not None]
    out += [t.clone() for store in (cache.recurrent, cache.conv) for t in store if t is not None]
    return out


def test_step_leaves_cache_untouched_and_prefill_chunks_agree(tiny_engine):
    model = tiny_engine.model
    gen = torch.Generator().manual_seed(5)
    B = 4
    prompt = torch.randint(0, 256, (1, 20), generator=gen)  # five whole blocks
    block = torch.randint(0, 256, (1, B), generator=gen)
    with torch.no_grad():
        one = model.new_cache()
        model.prefill(prompt, one, B, chunk_tokens=B)  # one block per chunk
        many = model.new_cache()
        model.prefill(prompt, many, B, chunk_tokens=12)  # three blocks in a chunk, then two
        for x, y in zip(_cache_state(one), _cache_state(many), strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        before = _cache_state(one)
        logits, _ = model.step(block, one)
        after = _cache_state(one)
        ref = model(torch.cat([prompt, block], 1), block_size=B)[:, 20:]
    assert one.length == 20
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=2e-5)


def test_cache_grown_while_holding_positions_keeps_them(tiny_engine):
    """A cache that was not reserved grows as blocks are committed (64, 128, 256 positions) and keeps what it
    holds: a 148-token prompt (37 blocks) committed 12 tokens at a time, so appends straddle each growth, equals
    one reserved up front, and a step on it equals the uncached forward."""
    model = tiny_engine.model
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    B = 4
    prompt = torch.randint(0, 256, (1, 148), generator=gen)
    block = torch.randint(0, 256, (1, B), generator=gen)
    with torch.no_grad():
        grown = model.new_cache()
        model.prefill(prompt, grown, B, chunk_tokens=12)
        reserved = model.new_cache(capacity=160)
        model.prefill(prompt, reserved, B, chunk_tokens=12)
        assert grown.capacity == 256 and reserved.capacity == 160 and grown.length == reserved.length == 148
        for x, y in zip(_cache_state(grown), _cache_state(reserved), strict=True):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
        logits, _ = model.step(block, grown)
        ref = model(torch.cat([prompt, block], 1), block_size=B)[:, 148:]
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=2e-5)


def test_reset_cache_generates_as_a_fresh_one(tiny_engine):
    """reset() forgets the committed positions and the GDN states: the recurrent and conv states are zero again
    and a step after a new prefill equals the same step on a fresh cache."""
    model = tiny_engine.model
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    B = 4
    first, second = torch.randint(0, 256, (1, 13), generator=gen), torch.randint(0, 256, (1, 9), generator=gen)
    block = torch.randint(0, 256, (1, B), generator=gen)
    assert model.config.gdn_layers
    with torch.no_grad():
        used = model.new_cache()
        model.prefill(first, used, B)
        assert any(float(used.recurrent[i].abs().max()) > 0 for i in model.config.gdn_layers)
        used.reset()
        assert used.length == 0
        for i in model.config.gdn_layers:
            assert not used.recurrent[i].any() and not used.conv[i].any()
        model.prefill(second, used, B)
        fresh = model.new_cache()
        model.prefill(second, fresh, B)
        for x, y in zip(_cache_state(used), _cache_state(fresh), strict=True):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
        torch.testing.assert_close(model.step(block, used)[0], model.step(block, fresh)[0], atol=0, rtol=0)


def test_reuse_commit_stores_the_last_steps_states(tiny_engine):
    """commit='reuse' keeps what the last step computed: the states of the block as it was then."""
    model = tiny_engine.model
    gen = torch.Generator().manual_seed(9)
    B, mask = 4, tiny_engine.mask_token_id
    prompt = torch.randint(0, 256, (1, 8), generator=gen)
    last_input = torch.tensor([[5, mask, 7, mask]])
    with torch.no_grad():
        reuse = model.new_cache()
        model.prefill(prompt, reuse, B)
        _, updates = model.step(last_input, reuse, keep_updates=True)
        model.commit(torch.tensor([[5, 6, 7, 8]]), reuse, B, updates=updates)
        clean = model.new_cache()
        model.prefill(torch.cat([prompt, last_input], 1), clean, B)
    assert reuse.length == clean.length == 12
    for x, y in zip(_cache_state(reuse), _cache_state(clean), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_reuse_mode_generates_end_to_end(tiny_engine):
    """12 tokens after a 5-token prompt at block 4 span positions 5..16: blocks [4, 8), [8, 12), [12, 16),
    [16, 20), the last one never committed. Exact commits each of the others with a clean forward; reuse keeps
    the last step's states and runs none."""
    for commit, forwards in (("reuse", 0), ("exact", 3)):
        out = tiny_engine.generate([1, 2, 3, 4, 5], max_new_tokens=12, commit=commit, threshold=0.006,
                                   ignore_eos=True, block_size=4)
        assert len(out.token_ids) == 12 and out.stats.blocks == 4
        assert out.stats.commit_forwards == forwards, commit


def test_block_causal_mask_hand_worked():
    """Queries 12..19 at block 4 against keys 0..19: queries 12-15 (block 3) see keys 0-15, queries 16-19
    (block 4) see all 20; one block, or no block size, needs no mask."""
    from clover_lite.models.denoiser import block_causal_mask

    mask = block_causal_mask(12, 8, 4, torch.device("cpu"))
    expected = torch.zeros(8, 20, dtype=torch.bool)
    expected[:4, :16] = True
    expected[4:, :] = True
    assert torch.equal(mask, expected)
    assert block_causal_mask(13, 3, 4, torch.device("cpu")) is None  # 13..15: inside block 3
    assert block_causal_mask(0, 9, None, torch.device("cpu")) is None
