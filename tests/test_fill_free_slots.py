"""Probes for canvas free-slot end handling and template slot leads."""

from clover_lite.runtime.canvas import fill_canvas
from clover_lite.runtime.generation import GenerationConfig
from clover_lite.runtime.template import Canvas, Slot, build_canvas, filled_text

from .test_fill import ScriptedRunner


def _free_canvas(end):
    slot_f = Slot(name="f", start=0, length=4)
    return Canvas(tokens=[None] * 4, slots=[slot_f], pieces=[slot_f], end_token_id=end)


def test_an_eos_token_other_than_the_end_token_also_ends_a_free_slot():
    """Canvas positions 0-3 (sequence 1-4) are free slot f; the model is sure of EOS id 10 (not the end token 9)
    at sequence 2: the slot ends there, its later positions take the end token without a forward."""
    end, eos = 9, 10
    script = {1: (11, 2.0), 2: (eos, 12.0), 3: (12, 1.0), 4: (13, 1.0)}
    runner = ScriptedRunner(script, vocab=16)
    cfg = GenerationConfig(block_size=8, threshold=0.99).resolved(4)
    res = fill_canvas(runner, [1], _free_canvas(end), cfg, mask_token_id=15, end_token_id=end, eos_token_ids=(eos,))
    assert res.slot_tokens == {"f": [11, eos, end, end]}
    assert res.steps == [[1, 2, 3], [0]]


def test_an_end_token_does_not_overwrite_a_position_committed_before_it():
    """Two positions pass the threshold in one forward: sequence 4 (token 13, logit 14) commits first, then the
    end token at sequence 2 ends the slot; only the still-masked sequence 3 takes the end token, and each canvas
    position is committed exactly once over the steps."""
    end = 9
    script = {1: (11, 2.0), 2: (end, 12.0), 3: (12, 1.0), 4: (13, 14.0)}
    runner = ScriptedRunner(script, vocab=16)
    cfg = GenerationConfig(block_size=8, threshold=0.99).resolved(4)
    res = fill_canvas(runner, [1], _free_canvas(end), cfg, mask_token_id=15, end_token_id=end)
    assert res.slot_tokens == {"f": [11, end, end, 13]}
    flat = [p for step in res.steps for p in step]
    assert sorted(flat) == [0, 1, 2, 3]


def test_a_tab_before_a_slot_moves_into_the_slot(tiny_engine):
    tok = tiny_engine.tokenizer
    c = build_canvas(tok, "go\t{d:left|right}!", None, 256, tiny_engine.mask_token_id)
    (slot,) = c.slots
    assert slot.lead == "\t" and slot.option_ids == [tok.encode("\tleft"), tok.encode("\tright")]
    assert c.tokens[: len(tok.encode("go"))] == tok.encode("go")
    assert filled_text(c, {"d": "left"}) == "go\tleft!"
