"""tokenizer/incremental.py with hand-made decodes (mutation round 4): the text after every push equals the decode
of all ids, with multi-byte characters split across pushes, a decode that is not local, and a first-piece space
that an empty context would lose; changed_from bounds what changed; ids_covering and the window's length."""

import random

from clover_lite.tokenizer.incremental import IncrementalDecoder

from .seed import SEED


def byte_decode(ids):
    """A byte-level decode: ids are UTF-8 bytes; a cut character shows as U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def push_in_chunks(dec, ids, rng):
    """Push `ids` in random chunks (some empty); yield (text before, text after) of each push."""
    i = 0
    while i < len(ids):
        k = rng.randint(0, 3)
        before = dec.text
        dec.push(ids[i:i + k])
        yield before, ids[:i + k]
        i += k


def test_multibyte_characters_split_across_pushes_decode_exactly_and_changed_from_bounds_the_change():
    """Random text with 2-4 byte characters, pushed as bytes in random chunks: after each push the text is the
    decode of every byte so far (a character cut at a push shows U+FFFD, then the whole character), and the text
    before changed_from is what it was before the push."""
    rng = random.Random(SEED)
    alphabet = "ab \u00e9\u00fc\u20ac\u4e2d\U0001f600"
    text = "".join(rng.choice(alphabet) for _ in range(120))
    ids = list(text.encode())
    dec = IncrementalDecoder(byte_decode, window=4)
    for before, so_far in push_in_chunks(dec, ids, rng):
        assert dec.text == byte_decode(so_far)
        assert 0 <= dec.changed_from <= len(dec.text)
        assert dec.text[:dec.changed_from] == before[:dec.changed_from]
    assert dec.text == text


def test_a_decode_that_is_not_local_is_redecoded_whole():
    """A decode whose text depends on every id (here: the letters reversed) breaks the window's premise: the
    decoder notices and the text still equals the decode of all ids at every push."""
    rng = random.Random(SEED + 1)

    def reversed_letters(ids):
        return "".join(chr(97 + i) for i in ids)[::-1]
    ids = [rng.randrange(26) for _ in range(40)]
    dec = IncrementalDecoder(reversed_letters, window=3)
    for _, so_far in push_in_chunks(dec, ids, rng):
        assert dec.text == reversed_letters(so_far)


PIECES = {0: "", 1: " a", 2: " b", 3: "c"}


def sentencepiece_like(ids):
    """Pieces joined, the text's first leading space dropped (sentencepiece); id 0 decodes to nothing."""
    return "".join(PIECES[i] for i in ids).removeprefix(" ")


def test_a_run_of_ids_that_show_no_text_does_not_cut_the_context_a_first_piece_space_needs():
    """' a', then ids that decode to nothing (more than the window), then ' b': the text is 'a b'. Starting the
    window at ids that show no text would decode ' b' as a first piece and lose its space ('ab')."""
    dec = IncrementalDecoder(sentencepiece_like, window=2)
    dec.push([1])
    for _ in range(5):
        dec.push([0])
    assert dec.push([2]) == "a b" == sentencepiece_like([1, 0, 0, 0, 0, 0, 2])
    rng = random.Random(SEED + 2)
    ids = [rng.choice([0, 0, 1, 2, 3]) for _ in range(60)]
    dec = IncrementalDecoder(sentencepiece_like, window=2)
    for _, so_far in push_in_chunks(dec, ids, rng):
        assert dec.text == sentencepiece_like(so_far)


def test_ids_covering_keeps_the_fewest_ids_whose_text_starts_with_the_cut():
    """Pieces 'ab', 'cd', 'ef': 'abc' needs 2 ids, 'ab' 1, 'abcdef' all 3, and the empty text none (a stop string
    at the very start keeps no id)."""
    pieces = ["ab", "cd", "ef"]

    def decode(ids):
        return "".join(pieces[i] for i in ids)
    dec = IncrementalDecoder(decode)
    dec.push([0, 1, 2])
    assert [dec.ids_covering(t) for t in ("abc", "ab", "abcdef", "a", "")] == [2, 1, 3, 1, 0]


def test_each_push_decodes_only_a_few_ids_at_the_end():
    """The point of the decoder: pushing the UTF-8 bytes of 300 characters (some of 2-4 bytes) one at a time with
    window 8, no decode call sees more than a window's worth of ids plus a character's, however long the text
    grows (a cut character is held back, never taken as a boundary); the text is still exact."""
    seen = []

    def counting(ids):
        seen.append(len(ids))
        return byte_decode(ids)
    rng = random.Random(SEED + 3)
    ids = list("".join(rng.choice("ab \u00e9\u20ac\U0001f600") for _ in range(300)).encode())
    dec = IncrementalDecoder(counting, window=8)
    for i in ids:
        dec.push([i])
    assert dec.text == byte_decode(ids)
    assert max(seen) <= 2 * 8
