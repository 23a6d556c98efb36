"""Incremental detokenization: at every length the text equals a full decode of the same ids, for the real
tokenizers (byte-level BPE, sentencepiece, Metaspace), and the decoding loop's events, stop strings and finish
reasons equal what re-decoding everything at each step gives."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from clover_lite.runtime.engine import BUNDLED_MODEL
from clover_lite.runtime.generation import BlockEvent, DoneEvent, GenerationConfig, StepEvent, denoise
from clover_lite.tokenizer.byte_tokenizer import write_byte_tokenizer, write_tokenizer_config
from clover_lite.tokenizer.incremental import IncrementalDecoder
from clover_lite.tokenizer.tokenizer import Tokenizer

from .seed import SEED
from .test_tokenizer import random_text


@pytest.fixture
def rng() -> random.Random:
    return random.Random(SEED)


# ---------------------------------------------------------------- tokenizers


def _train_sp(byte_fallback: bool) -> bytes:
    gen = random.Random(1234)
    words = ["".join(gen.choice("abcdefghijklmnopqrstuvwxyzäöü世界") for _ in range(gen.randint(1, 8)))
             for _ in range(300)]
    lines = [" ".join(gen.choice(words) for _ in range(gen.randint(3, 15))) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, model_type="unigram",
                                   vocab_size=360 if byte_fallback else 250, byte_fallback=byte_fallback,
                                   character_coverage=0.98 if byte_fallback else 1.0, minloglevel=2)
    return model.getvalue()


def _sp_dir(out: Path, byte_fallback: bool) -> Path:
    """A sentencepiece model plus added tokens (one special, one not), as tokenizer_config.json lists them."""
    out.mkdir()
    proto = _train_sp(byte_fallback)
    (out / "tokenizer.model").write_bytes(proto)
    n = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    added = {"0": {"content": "<unk>", "special": True}, "1": {"content": "<s>", "special": True},
             "2": {"content": "</s>", "special": True}, str(n): {"content": "<|mask|>", "special": True},
             str(n + 1): {"content": "<tool>", "special": False}}
    (out / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added, "eos_token": "</s>"}))
    return out


def _hf_dir(out: Path, fallback_bytes: bool) -> Path:
    """A BPE tokenizer.json trained here: Metaspace pre-tokenizer and decoder, or Llama's decoder chain with byte
    tokens (<0x00>..<0xFF>) for what the vocabulary lacks."""
    gen = random.Random(99)
    lines = [" ".join("".join(gen.choice("abcdefgäö世") for _ in range(gen.randint(1, 6))) for _ in range(10))
             for _ in range(500)]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    if fallback_bytes:
        spec = json.loads(tok.to_str())["model"]
        vocab = dict(spec["vocab"])
        vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
        pre = tok.pre_tokenizer
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
        tok.pre_tokenizer = pre
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    else:
        tok.decoder = decoders.Metaspace()
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, tok, ["<s>", "</s>"], "</s>", "</s>", None, 1 << 20)
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("detok")
    write_byte_tokenizer(root / "bytes")
    dirs = {"bundled byte-level BPE": BUNDLED_MODEL, "byte tokenizer": root / "bytes",
            "sentencepiece": _sp_dir(root / "sp", False), "sentencepiece byte fallback": _sp_dir(root / "spb", True),
            "HF Metaspace": _hf_dir(root / "meta", False), "HF byte fallback": _hf_dir(root / "llama", True)}
    return {name: Tokenizer.from_dir(d) for name, d in dirs.items()}


# Llama's chain is not windowed: a later byte token can turn a whole run of earlier ones into U+FFFD.
NOT_LOCAL = {"HF byte fallback"}


def _random_ids(tok: Tokenizer, rng: random.Random) -> list[int]:
    """Uniform ids (specials and cut multi-byte characters included), or random unicode text's ids with
    specials and stray ids mixed in."""
    if rng.random() < 0.4:
        return [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 60))]
    ids = tok.encode(random_text(rng, 50))
    for _ in range(rng.randint(0, 4)):
        ids.insert(rng.randint(0, len(ids)), rng.choice([*tok.special_token_ids, rng.randrange(tok.vocab_size)]))
    return ids


def test_incremental_text_is_the_full_decode_at_every_length(tokenizers, rng: random.Random) -> None:
    for name, tok in tokenizers.items():
        assert tok.incremental_decoder().windowed == (name not in NOT_LOCAL), name
        for _ in range(150):
            skip = rng.random() < 0.5
            ids = _random_ids(tok, rng)
            dec = tok.incremental_decoder(skip_special_tokens=skip)
            n = 0
            while n < len(ids):
                before, pushed = dec.text, n
                n = min(len(ids), n + rng.choice([0, 1, 1, 2, 3, 4, 7]))  # some pushes add nothing
                dec.push(ids[pushed:n])
                assert dec.text == tok.decode(ids[:n], skip_special_tokens=skip), (name, skip, ids[:n])
                # What the stop-string search skips really is unchanged.
                assert dec.text[: dec.changed_from] == before[: dec.changed_from], (name, ids[:n])
            assert dec.windowed == (name not in NOT_LOCAL), (name, ids)  # never had to fall back


def test_per_push_work_does_not_grow_with_the_text(tokenizers, rng: random.Random) -> None:
    """The ids decoded per push stay as few on a reply four times as long: a window since the last clean boundary
    (longer while the text keeps ending in a cut character, as across the bytes of emoji sequences)."""
    tok = tokenizers["bundled byte-level BPE"]
    decoded: list[int] = []  # ids per decode call
    counting = lambda ids: decoded.append(len(ids)) or tok.decode(ids)
    for segments in (100, 400):
        ids = tok.encode(" ".join(random_text(rng, 30) for _ in range(segments)))
        per_push, n = [], 0
        dec = IncrementalDecoder(counting)
        while n < len(ids):
            decoded.clear()
            k = rng.randint(1, 4)
            dec.push(ids[n : n + k])
            n += k
            per_push.append(sum(decoded))
        assert dec.text == tok.decode(ids) and len(ids) > 4000
        assert sum(per_push) / len(per_push) < 30 and max(per_push) < 250, (segments, max(per_push))


def test_a_decode_that_is_not_local_falls_back_to_re_decoding() -> None:
    """A decode whose window text stops starting with its context (the first id's text changes with the last's)
    is found out and re-decoded in full from then on: still exact."""
    decode = lambda ids: ("A" if ids and ids[-1] == 9 else "a") * bool(ids) + "".join(map(str, ids[1:]))
    dec = IncrementalDecoder(decode, window=2)
    ids = [1, 2, 3, 4, 5, 6, 9, 7]
    for n in range(1, len(ids) + 1):
        assert dec.push(ids[n - 1 : n]) == decode(ids[:n])
    assert not dec.windowed


# ---------------------------------------------------------------- the decoding loop


class RandomRunner:
    """Position p predicts `tokens[p]` with probability `probs[p]`, the rest spread evenly: the threshold policy
    commits random subsets of a block, so the contiguous prefix grows unevenly."""

    device = torch.device("cpu")

    def __init__(self, tokens: list[int], probs: list[float], vocab: int):
        self.tokens, self.probs, self.vocab, self.start = tokens, probs, vocab, 0

    def reserve(self, n):
        pass

    def prefill(self, ids):
        self.start = len(ids)

    def step(self, block, positions):
        rows = torch.full((len(positions), self.vocab), 0.0, dtype=torch.float64)
        for r, j in enumerate(positions):
            p = self.start + j
            rows[r] = (1 - self.probs[p]) / (self.vocab - 1)
            rows[r, self.tokens[p]] = self.probs[p]
        return rows.log().float()

    def commit(self, block):
        self.start += len(block)
        return 0


def reference_texts(events, prompt_len: int, cfg: GenerationConfig, eos: set[int], decode):
    """What the loop gave before incremental decoding, from each step's block alone: the contiguous committed
    prefix ends at the first stop token, and its decode is cut at the first stop string, which comes first and so
    wins over the stop token (the result keeping the fewest ids that show the cut text)."""
    stop_ids = set(cfg.stop_token_ids) | eos
    generated, expected = [], []
    for ev in events:
        if isinstance(ev, BlockEvent):
            generated += ev.tokens[max(prompt_len - ev.block_start, 0) :]
            expected.append((ev, None, decode(generated)))
        if not isinstance(ev, StepEvent):
            continue
        prefix, result = [], None
        for t in generated + ev.block[max(prompt_len - ev.block_start, 0) :]:
            if t is None:
                break
            if t in stop_ids:
                result = ("eos" if t in eos else "stop", prefix, decode(prefix))
                break
            prefix.append(t)
        if cfg.stop and prefix:  # a stop string before the stop token ends the reply there
            text = decode(prefix)
            hits = [text.find(s) for s in cfg.stop if s in text]
            if hits:  # the text up to the stop string, and the fewest ids whose decode starts with it
                cut = text[: min(hits)]
                k = next(k for k in range(len(prefix) + 1) if decode(prefix[:k]).startswith(cut))
                result = ("stop", prefix[:k], cut)
        expected.append((ev, result, result[2] if result else decode(prefix)))
    return expected, generated


@pytest.mark.parametrize("name", ["bundled byte-level BPE", "sentencepiece byte fallback", "HF Metaspace"])
def test_loop_events_and_stops_match_full_re_decoding(tokenizers, name: str, rng: random.Random) -> None:
    tok = tokenizers[name]
    mask = tok.vocab_size  # an id outside the vocab stands in for the mask: never chosen, never decoded
    eos = sorted(tok.eos_token_ids)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    for trial in range(12):
        prompt = tok.encode(random_text(rng, 10)) or [5]
        n_new = rng.randint(1, 80)
        if trial % 2:
            reply = [rng.randrange(tok.vocab_size) for _ in range(n_new)]  # specials, eos, cut characters
        else:
            reply = (tok.encode(random_text(rng, 80)) + [rng.randrange(tok.vocab_size)])[:n_new]
        tokens = list(prompt) + reply + [5] * (n_new - len(reply))
        probs = [rng.uniform(0.5, 1.0) for _ in tokens]
        text = decode([t for t in reply if t not in eos])
        k = rng.randrange(max(len(text), 1))
        stop = () if trial % 3 == 2 or not text else (text[k : k + rng.randint(1, 5)], "\x00never")
        cfg = GenerationConfig(max_new_tokens=n_new, block_size=4, threshold=0.9, stop=stop,
                               ignore_eos=trial % 4 == 1).resolved(None)
        eos_ids = set() if cfg.ignore_eos else set(eos)
        runs = []
        for kw in ({"detokenizer": tok.incremental_decoder(skip_special_tokens=True)}, {"decode": decode}):
            runs.append(list(denoise(RandomRunner(tokens, probs, tok.vocab_size + 1), prompt, cfg, mask,
                                     eos, **kw)))
        fast, full = runs
        assert [(type(e), getattr(e, "text", None)) for e in fast] == [(type(e), getattr(e, "text", None))
                                                                        for e in full]
        expected, generated = reference_texts(fast[:-1], len(prompt), cfg, eos_ids, decode)
        for ev, _, want in expected:
            assert ev.text == want, (name, trial, ev)
        done = fast[-1].generation
        assert isinstance(fast[-1], DoneEvent) and done.text == full[-1].generation.text
        last = expected[-1][1]
        if last is not None:  # the loop stops at the first step whose prefix holds a stop
            assert (done.finish_reason, done.token_ids, done.text) == last
            assert all(result is None for _, result, _ in expected[:-1])
        else:
            assert (done.finish_reason, done.token_ids, done.text) == ("length", generated, decode(generated))


def test_engine_stream_texts_are_full_decodes(tiny_engine, rng: random.Random) -> None:
    """The engine's events and result through its tokenizer's incremental decoder: each text is the decode of
    the contiguous committed reply so far (cut at a stop string)."""
    e = tiny_engine
    first = e.generate("Hi", max_new_tokens=24, ignore_eos=True)
    k = rng.randrange(max(len(first.text), 1))
    stop = first.text[k : k + 3] or "x"
    events = list(e.stream("Hi", max_new_tokens=24, ignore_eos=True, stop=stop))
    cfg = e.resolve_config(max_new_tokens=24, ignore_eos=True, stop=stop)
    expected, generated = reference_texts(events[:-1], len(e.encode_prompt("Hi")), cfg, set(), e.decode)
    assert [ev.text for ev, _, _ in expected] == [want for _, _, want in expected]
    done = events[-1].generation
    want = expected[-1][1] or ("length", generated, e.decode(generated))
    assert (done.finish_reason, done.token_ids, done.text) == want
