"""quant/calibration.py (mutation round 4): what reads as calibration text (the 20% share of bytes that are not
UTF-8, a NUL, JSONL blank lines and chat messages), the token stream's separator and early stop, and the
windows and masks calibration_ids draws, all against hand-worked cases."""

import json
import random

import pytest
import torch

from clover_lite.errors import CloverError
from clover_lite.quant.calibration import calibration_ids, read_calibration_file, token_stream

from .seed import SEED


def test_the_share_of_bytes_that_are_not_utf8_decides_text_or_binary(tmp_path):
    """One stray byte in five (20%) still reads as text, each as U+FFFD; one in three is binary, refused naming
    the first bad offset."""
    fifth = tmp_path / "fifth.txt"
    fifth.write_bytes(b"abcd\xe9" * 50)
    assert read_calibration_file(fifth) == ["abcd\ufffd" * 50]
    third = tmp_path / "third.txt"
    third.write_bytes(b"ab\xe9" * 50)
    with pytest.raises(CloverError, match=r"not text \(binary bytes from offset 2\)"):
        read_calibration_file(third)


def test_a_nul_in_otherwise_readable_latin1_text_is_binary_and_named_by_its_offset(tmp_path):
    """A file with a few Latin-1 bytes (which alone would read) and a NUL before the first of them is binary:
    the error names the NUL's offset, the first bad byte."""
    p = tmp_path / "notes.txt"
    data = b"plain\x00 words then caf\xe9 and more plain words to keep the share of bad bytes low"
    p.write_bytes(data)
    with pytest.raises(CloverError, match=r"binary bytes from offset 5\)"):
        read_calibration_file(p)


def test_jsonl_skips_blank_lines_and_joins_chat_messages_by_lines(tmp_path):
    """JSONL: blank lines are no documents; a "messages" document is its contents joined with newlines (entries
    that are not objects dropped, a missing content empty); a bare string is a document."""
    p = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": "first doc"}), "", "   ",
             json.dumps({"messages": [{"role": "user", "content": "hi there"}, "junk",
                                      {"role": "assistant", "content": "hello"}, {"role": "user"}]}),
             json.dumps("a bare string"), ""]
    p.write_text("\n".join(lines))
    assert read_calibration_file(p) == ["first doc", "hi there\nhello\n", "a bare string"]


class CharTokenizer:
    """A tokenizer stand-in: one id per character (its code point), counting the texts it encoded."""

    def __init__(self):
        self.encoded = 0

    def encode(self, text):
        self.encoded += 1
        return [ord(c) for c in text]


def test_token_stream_separates_with_any_id_including_zero_and_stops_reading_at_max_tokens():
    """Texts are encoded back to back with the separator after each (id 0 is a separator like any other); once
    max_tokens ids are in, no further text is read (the default text is read lazily)."""
    rng = random.Random(SEED)
    texts = ["".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(1, 6))) for _ in range(5)]
    want = []
    for t in texts:
        want += [ord(c) for c in t] + [0]
    assert token_stream(CharTokenizer(), texts, separator=0) == want
    assert token_stream(CharTokenizer(), texts, separator=None) == [ord(c) for c in "".join(texts)]

    def endless():
        while True:
            yield "abc"
    tok = CharTokenizer()
    got = token_stream(tok, endless(), separator=7, max_tokens=10)
    assert got == [97, 98, 99, 7] * 3 and tok.encoded == 3  # 12 >= 10 after the third text: stop there


def test_calibration_needs_more_than_one_window_of_tokens():
    """A stream of exactly seqlen tokens is refused with the CloverError that says to give more text; one more
    token is enough."""
    with pytest.raises(CloverError, match="a window of 8 needs at least 9"):
        calibration_ids(list(range(8)), nsamples=2, seqlen=8, seed=0, mode="clean")
    assert calibration_ids(list(range(9)), nsamples=2, seqlen=8, seed=0, mode="clean").tolist() == [
        list(range(8))] * 2


def test_diffusion_windows_mask_only_their_last_block_at_ratios_from_a_tenth_to_all():
    """Each row is a window of the stream; in diffusion mode only the last block of the block grid is masked
    (seqlen 8, block 4: positions 4..7), at least one token in each, and over 10 samples the masked counts are
    max(1, round(r * 4)) for r = 0.1, 0.2, ..., 1.0 (1,1,1,2,2,2,3,3,4,4). With seqlen 9 the last block is the
    single position 8."""
    rng = random.Random(SEED)
    stream = [rng.randrange(1, 500) for _ in range(200)]
    mask = 999

    def check_rows(ids, seqlen, last):
        counts = []
        for row in ids.tolist():
            starts = [s for s in range(len(stream) - seqlen + 1)
                      if all(row[j] == stream[s + j] for j in range(seqlen) if row[j] != mask)]
            assert starts, row  # every unmasked token is the stream's at one window start
            assert all(v != mask for v in row[:last])
            counts.append(sum(v == mask for v in row[last:]))
        return counts

    ids = calibration_ids(stream, nsamples=10, seqlen=8, seed=SEED, mode="diffusion", block_size=4,
                          mask_token_id=mask)
    assert ids.shape == (10, 8) and ids.dtype == torch.long
    assert sorted(check_rows(ids, 8, 4)) == [1, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    ids = calibration_ids(stream, nsamples=3, seqlen=9, seed=SEED, mode="diffusion", block_size=4,
                          mask_token_id=mask)
    assert check_rows(ids, 9, 8) == [1, 1, 1]
