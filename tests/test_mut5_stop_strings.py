"""Mutation round 5: stop strings in the decoding loop, on test_decoding's scripted runner (one letter per token,
every position confident, so a block of 4 commits in one step and each step's text is known by hand)."""

import pytest

from .test_decoding import Scripted, run


@pytest.mark.parametrize("stop", [("hi", "g"), ("g", "hi"), ("ghi", "hi", "i")])
def test_the_earliest_of_several_stop_strings_in_one_step_cuts_the_reply(stop):
    """Generated positions 4-7 decode to 'fghi', all committed in the first step. Every listed stop string
    occurs in that step's text; the reply ends before the one that starts first ('g' or 'ghi' at offset 1,
    whatever the list order), keeping only the id of 'f'."""
    r = Scripted(lambda p: 0.99)
    _, out = run(r, [1, 2, 3, 4], max_new_tokens=8, block_size=4, stop=stop)
    assert (out.text, out.token_ids, out.finish_reason) == ("f", [r.token_at(4)], "stop")
