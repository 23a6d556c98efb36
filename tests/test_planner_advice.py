"""Probes: the planner's advice when a model does not fit (INT4 at bf16 for an fp32 plan, the lm_head saving),
the load check's default context, the prefill chunk of a context shorter than a block."""
import dataclasses

import torch

from clover_lite.planning.devices import fmt_bytes
from clover_lite.planning.planner import LOAD_CHECK_CONTEXT, plan

GiB = 1 << 30


def test_fp32_advice_quotes_int4_at_bf16():
    p = plan("clover-35b-a3b", "fp32", 8192, "rtx4090")
    q = plan("clover-35b-a3b", "int4", 8192, "rtx4090", dtype="bf16")
    assert f"use INT4 weights (clover quantize SRC OUT): {fmt_bytes(q.total)} at 8192 tokens, fits" in p.suggestions()


def test_int4_advice_offers_quantizing_lm_head_with_its_saving():
    p = plan("clover-35b-a3b", "int4", 131072, "rtx4090")
    q = plan("clover-35b-a3b", "int4", 131072, "rtx4090", quantize_lm_head=True)
    assert q.total < p.total
    line = f"quantize lm_head too (clover quantize --quantize-lm-head): saves {fmt_bytes(p.total - q.total)}, "
    assert any(s.startswith(line) for s in p.suggestions()), p.suggestions()


def test_load_check_context_is_capped_for_long_context_models(tiny_dir, monkeypatch):
    import clover_lite.planning.planner as planner
    from clover_lite.models.config import load_config
    from clover_lite.planning import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "cuda_free_memory", lambda dev: (20 * GiB, 24 * GiB))
    config = dataclasses.replace(load_config(tiny_dir), max_position_embeddings=1 << 20)
    p = planner.check_load(tiny_dir, config, torch.device("cuda"), torch.bfloat16)
    assert p.context_len == LOAD_CHECK_CONTEXT


def test_prefill_chunk_is_at_least_a_block():
    assert plan("tiny", "bf16", 2, block_size=4).prefill_chunk == 4
    assert plan("tiny", "bf16", 0, block_size=8).prefill_chunk == 8
