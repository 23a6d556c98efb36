"""Mutation round 5: fill-in templates against a byte-level tokenizer written here (one token per byte), so each
expected layout is counted by hand."""

import pytest

from clover_lite.errors import GenerationError
from clover_lite.runtime.template import build_canvas, filled_text

MASK = 300


class Bytes:
    """One token per UTF-8 byte."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_inline_length_may_be_written_with_spaces():
    """'{n: 3 }' is a free slot of 3 positions (the spec is a number once stripped), not a one-option choice."""
    c = build_canvas(Bytes(), "ab{n: 3 }c", None, end_token_id=0, mask_token_id=MASK)
    (slot,) = c.slots
    assert slot.options is None and slot.option_ids is None
    assert (slot.start, slot.length) == (2, 3)
    assert c.tokens == [97, 98, None, None, None, 99]


def test_two_option_lengths_without_an_end_token_are_refused():
    """Options of two different token lengths ('ab' 2, 'abc' 3) need an end token to pad the shorter one: with
    none the template is refused naming the slot; equal lengths, or an end token, are accepted."""
    with pytest.raises(GenerationError, match="slot 'x': its options have different token lengths"):
        build_canvas(Bytes(), "{x:ab|abc}", None, end_token_id=None, mask_token_id=MASK)
    c = build_canvas(Bytes(), "{x:ab|cd}", None, end_token_id=None, mask_token_id=MASK)
    assert c.slots[0].length == 2
    c = build_canvas(Bytes(), "{x:ab|abc}", None, end_token_id=7, mask_token_id=MASK)
    assert c.slots[0].padded(7) == [[97, 98, 7], [97, 98, 99]]
    assert filled_text(c, {"x": "abc"}) == "abc"


def test_a_free_slot_may_take_exactly_max_slot_positions():
    """A free slot takes 1 to MAX_SLOT_POSITIONS (4096) positions, both ends included; 0 and 4097 are refused."""
    c = build_canvas(Bytes(), "a{x:4096}", None, end_token_id=0, mask_token_id=MASK)
    assert c.slots[0].length == 4096 and c.tokens.count(None) == 4096
    assert build_canvas(Bytes(), "{x:1}", None, end_token_id=0, mask_token_id=MASK).tokens == [None]
    for n in (0, 4097):
        with pytest.raises(GenerationError, match=f"slot 'x': {n} positions; give 1 to 4096"):
            build_canvas(Bytes(), f"{{x:{n}}}", None, end_token_id=0, mask_token_id=MASK)
