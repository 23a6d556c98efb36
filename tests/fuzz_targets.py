"""The readers' fuzz targets (config.json, tokenizer.json, tokenizer_config.json, the chat template, the safetensors
header, quantize_config.json): each takes one mutated file and checks that reading it either works or raises
clover-lite's own error, never another exception. Run boundedly by tests/test_fuzz_readers.py and at
length by benchmarks/fuzz_readers.py."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

from clover_lite.errors import CloverError
from tests.json_fuzz import mutate_bytes, mutated_json_texts


def _model_dir(base: Path, name: str) -> Path:
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(base / name, seed=0)


def read_config(model: Path) -> None:
    import clover_lite
    from clover_lite.models.config import load_config

    load_config(model)
    clover_lite.load(model, device="cpu", static_step=False)  # a config that reads must build or refuse


def read_tokenizer(model: Path) -> None:
    from clover_lite.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    ids = tok.encode("héllo <|im_end|> 12")
    tok.decode(ids, skip_special_tokens=True)
    if tok.has_chat_template:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def read_quantized(model: Path) -> None:
    import clover_lite

    clover_lite.load(model, device="cpu", static_step=False).generate("hi", max_new_tokens=4)


class Target:
    """One file of a model directory, mutated `cases` times and read each time with `read`."""

    def __init__(self, name: str, file: str, read: Callable[[Path], None], quantized: bool = False,
                 template: bool = False, safetensors: bool = False) -> None:
        self.name, self.file, self.read, self.quantized, self.template = name, file, read, quantized, template
        self.safetensors = safetensors

    def cases(self, original: bytes, rng: random.Random, n: int) -> list[bytes]:
        if self.safetensors:  # the JSON header mutated as JSON (length prefix kept right), or the raw bytes
            n_header = int.from_bytes(original[:8], "little")
            header, body = json.loads(original[8 : 8 + n_header]), original[8 + n_header :]
            out = []
            for text in mutated_json_texts(header, rng, n):
                if rng.random() < 0.2:
                    out.append(mutate_bytes(original[: 8 + n_header + 64], rng) + original[8 + n_header + 64 :])
                else:
                    out.append(len(text).to_bytes(8, "little") + text + body)
            return out
        if self.template:  # the chat template's text itself, mutated inside a valid tokenizer_config.json
            config = json.loads(original)
            out = []
            for _ in range(n):
                cfg = dict(config)
                cfg["chat_template"] = mutate_bytes(config["chat_template"].encode(), rng).decode("utf-8", "replace")
                out.append(json.dumps(cfg).encode())
            return out
        return mutated_json_texts(json.loads(original), rng, n)

    def run(self, base: Path, seed: int, n: int) -> dict[str, int]:
        """Read `n` mutations; return how many read and how many were refused with our error."""
        model = _model_dir(base, self.name)
        if self.quantized:
            from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

            q = base / f"{self.name}-int4"
            quantize_model(model, q, QuantizeOptions(method="rtn", group_size=32, nsamples=2, seqlen=16))
            shutil.rmtree(model)
            model = q
        path = model / self.file
        original = path.read_bytes()
        counts = {"read": 0, "refused": 0}
        for k, case in enumerate(self.cases(original, random.Random(seed), n)):
            path.write_bytes(case)
            try:
                self.read(model)
                counts["read"] += 1
            except CloverError:
                counts["refused"] += 1
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{self.name}, seed {seed}, case {k}: {type(e).__name__}: {e}\n"
                                     f"file {self.file}: {case[:300]!r}") from e
        path.write_bytes(original)
        return counts


TARGETS = {
    "config": Target("config", "config.json", read_config),
    "tokenizer": Target("tokenizer", "tokenizer.json", read_tokenizer),
    "tokenizer_config": Target("tokenizer_config", "tokenizer_config.json", read_tokenizer),
    "chat_template": Target("chat_template", "tokenizer_config.json", read_tokenizer, template=True),
    "safetensors_header": Target("safetensors_header", "model.safetensors", read_config, safetensors=True),
    "quantize_config": Target("quantize_config", "quantize_config.json", read_quantized, quantized=True),
}
