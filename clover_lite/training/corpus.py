"""Training data of the bundled model: Python standard library text, its BPE tokenizer, and the
task/text mix of the training windows.

Text is what exists wherever Python does: the stdlib's .py files (tests excluded; pydoc's topic
docs are among them). A file is held out when a hash of its relative path says so, so the split is
the same on every machine with the same Python. Tasks come from `clover_lite.training.tasks`.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from clover_lite.tokenizer.byte_tokenizer import DEFAULT_SPECIALS, write_tokenizer_config
from clover_lite.training import tasks

SPECIALS = DEFAULT_SPECIALS  # ids 0..3 here (trained BPE), 256.. in the byte tokenizer
EOT, MASK = "<|endoftext|>", "<|mask|>"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
HELDOUT_EVERY = 20  # ~5% of the files

# Qwen2's pre-tokenizer split: single digits, letters with one leading non-letter, punctuation runs,
# newlines, spaces. Single digits keep numbers learnable for a tiny model.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---- text --------------------------------------------------------------------------------------
def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's .py files outside test directories, sorted by relative path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in base.rglob("*.py"):
        rel = p.relative_to(base)
        if not any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def is_heldout(path: Path, root: str | os.PathLike | None = None) -> bool:
    rel = path.relative_to(Path(root or sysconfig.get_paths()["stdlib"])).as_posix()
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def split_files(root: str | os.PathLike | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files)."""
    files = stdlib_files(root)
    held = [p for p in files if is_heldout(p, root)]
    return [p for p in files if not is_heldout(p, root)], held


def read_texts(files: Iterable[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


# ---- tokenizer ---------------------------------------------------------------------------------
def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> HFTokenizer:
    """Byte-level BPE with the specials at ids 0..3 (Qwen2-style split, single digits)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer(tok: HFTokenizer, out_dir: str | os.PathLike) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML template, eos <|im_end|>, mask <|mask|>)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, tok, SPECIALS, "<|im_end|>", MASK, tasks.CHAT_TEMPLATE, 8192)


def encode_corpus(tok: HFTokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one int32 token stream, each followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


# ---- training windows --------------------------------------------------------------------------
class MixedBatches:
    """Windows of `length` tokens: `task_windows` of packed task chats (each window starts with a chat,
    as a prompt does at inference) and the rest random slices of the text stream. The batch of a step
    is a function of (seed, step) alone, so a resumed run sees the same data.

    In chats the reply is maskable and so is the rest of every block from its first reply position on
    (`until_block_end`): at inference the positions after the answer in its last block are masks too, and
    the model must learn to end the answer there without seeing what follows. `block_size` None, or steps
    before `extend_from`, keep only the reply maskable (the first 857 steps of the bundled run did that).

    `task_weights` (task -> integer weight) changes how often each task is drawn from step `reweight_from`
    on; before that, and when None, every base task (`tasks.BASE_TASKS`) is equally likely.
    """

    def __init__(
        self,
        tok: HFTokenizer,
        text_ids: torch.Tensor,
        batch: int,
        length: int,
        task_windows: int,
        seed: int,
        block_size: int | None = None,
        extend_from: int = 0,
        task_weights: dict[str, int] | None = None,
        reweight_from: int = 0,
    ):
        self.tok, self.text, self.batch, self.length = tok, text_ids, batch, length
        self.task_windows, self.seed = task_windows, seed
        self.block_size, self.extend_from = block_size, extend_from
        self.eot = tok.token_to_id(EOT)
        known = tasks.TASKS + tasks.TRAIN_ONLY
        if unknown := set(task_weights or {}) - set(known):
            raise ValueError(f"unknown task(s) {sorted(unknown)} in task weights; tasks are {known}")
        # A task repeated w times in the tuple is drawn w times as often by sample_train's rng.choice.
        self.weighted = tuple(t for t, w in (task_weights or {}).items() for _ in range(w)) or tasks.BASE_TASKS
        self.reweight_from = reweight_from

    def task_window(self, rng: random.Random,
                    mix: tuple[str, ...] = tasks.BASE_TASKS) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        maskable: list[bool] = []
        while len(ids) < self.length:
            chat, answer = encode_chat(self.tok, tasks.sample_train(rng, mix))
            ids += chat
            maskable += answer
        return ids[: self.length], maskable[: self.length]

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(windows [batch, length], maskable [batch, length]): task rows first, then text rows."""
        rng = random.Random(self.seed * 1_000_003 + step)
        rows, maskable = [], []
        mix = self.weighted if step >= self.reweight_from else tasks.BASE_TASKS
        for _ in range(self.task_windows):
            ids, m = self.task_window(rng, mix)
            rows.append(ids)
            maskable.append(m)
        for _ in range(self.batch - self.task_windows):
            s = rng.randrange(len(self.text) - self.length)
            rows.append(self.text[s : s + self.length].tolist())
            maskable.append([True] * self.length)
        maskable_t = torch.tensor(maskable, dtype=torch.bool)
        if self.block_size is not None and step >= self.extend_from:
            maskable_t = until_block_end(maskable_t, self.block_size)
        return torch.tensor(rows, dtype=torch.long), maskable_t


def until_block_end(maskable: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every position of a block from its first maskable one on (bool [b, T], T a multiple of B)."""
    b, T = maskable.shape
    blocks = maskable.reshape(b, T // block_size, block_size).to(torch.int8)
    return torch.cummax(blocks, dim=-1).values.bool().reshape(b, T)


def encode_chat(tok: HFTokenizer, ex: tasks.Example) -> tuple[list[int], list[bool]]:
    """Token ids of a training conversation followed by <|endoftext|>, and which of them are the reply
    (answer + <|im_end|>): only those are ever masked, the prompt stays clean as it is at inference."""
    prompt = tok.encode(tasks.chat_prompt(ex.prompt)).ids
    reply = tok.encode(ex.answer + "<|im_end|>").ids
    tail = tok.encode("\n").ids + [tok.token_to_id(EOT)]
    return prompt + reply + tail, [False] * len(prompt) + [True] * len(reply) + [False] * len(tail)
