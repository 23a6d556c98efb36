"""Checkpoint loading: layouts (single, sharded, fused experts), casting, and every bad-input error."""

import json
import os
import random
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover_lite.checkpoint.load import load_model
from clover_lite.checkpoint.tiny import write_tiny_checkpoint
from clover_lite.errors import CheckpointError, ConfigError
from clover_lite.models import load_config

from .seed import SEED


@pytest.fixture()
def ckpt(tiny_dir, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(tiny_dir, out)
    return out


def _load(path, dtype=torch.float32):
    return load_model(path, load_config(path), "cpu", dtype)[0]


def _same_weights(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_sharded_equals_single(tiny_dir, tmp_path):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", seed=1234, max_shard_bytes=200_000)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    _same_weights(_load(tiny_dir), _load(sharded))
    umask = os.umask(0)
    os.umask(umask)
    # Written through a 0700 temporary directory and safetensors' 0600 files, published like a plain mkdir.
    assert {f.stat().st_mode & 0o777 for f in sharded.iterdir()} == {0o666 & ~umask}
    assert sharded.stat().st_mode & 0o777 == 0o777 & ~umask


def test_fused_expert_tensors_and_language_model_prefix(ckpt, tiny_dir):
    """The same weights stored as fused 3-D expert tensors under a multimodal-style prefix."""
    tensors = load_file(ckpt / "model.safetensors")
    config = load_config(ckpt)
    out = {}
    for layer in range(config.num_hidden_layers):
        base = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([
            torch.cat([tensors.pop(f"{base}.{e}.gate_proj.weight"), tensors.pop(f"{base}.{e}.up_proj.weight")])
            for e in range(config.num_experts)
        ])
        down = torch.stack([tensors.pop(f"{base}.{e}.down_proj.weight") for e in range(config.num_experts)])
        out[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        out[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = down
    for name, t in tensors.items():
        out[name.replace("model.", "model.language_model.", 1)] = t
    out["mtp.layers.0.fc.weight"] = torch.zeros(2, 2)  # multi-token-prediction head: skipped
    save_file(out, ckpt / "model.safetensors")
    model, report = load_model(ckpt, config, "cpu", torch.float32)
    _same_weights(model, _load(tiny_dir))
    assert report.skipped == ["mtp.layers.0.fc.weight"] and "mtp" in report.notes[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casting(tiny_dir, dtype):
    ref = _load(tiny_dir)
    low = _load(tiny_dir, dtype)
    for (name, a), (_, b) in zip(ref.named_parameters(), low.named_parameters(), strict=True):
        assert b.dtype == dtype, name
        assert torch.equal(a.to(dtype), b), name
    with torch.no_grad():
        ids = torch.randint(0, 256, (1, 9))
        torch.testing.assert_close(low(ids, block_size=4), ref(ids, block_size=4), atol=0.1, rtol=0.1)


def _rewrite(ckpt, fn):
    tensors = load_file(ckpt / "model.safetensors")
    fn(tensors)
    save_file(tensors, ckpt / "model.safetensors")


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        _load(ckpt)


def test_missing_lm_head_when_untied(ckpt):
    _rewrite(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        _load(ckpt)


def test_unexpected_tensors_are_listed(ckpt):
    def add(t):
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 4)
        t["model.layers.9.mlp.gate.weight"] = torch.zeros(4, 4)

    _rewrite(ckpt, add)
    with pytest.raises(CheckpointError) as e:
        _load(ckpt)
    msg = str(e.value)
    assert "2 unexpected" in msg and "layers.0.self_attn.q_proj.weight" in msg and "layers.9.mlp.gate" in msg
    assert "model.safetensors" in msg


def test_shape_mismatch_names_tensor_and_file(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.zeros(65)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*model\.safetensors.*\[65\].*\[64\]"):
        _load(ckpt)


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(ckpt)
    f.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(ckpt)


def test_corrupt_header(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10) + b"{not json!" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        _load(ckpt)


def _with_header(f, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("entry, why", [
    ({"dtype": "F32", "data_offsets": [0, 16]}, "shape None"),  # missing key: was KeyError 'shape'
    ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, "shape '4'"),
    ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "shape"),
    ({"dtype": 7, "shape": [4], "data_offsets": [0, 16]}, "dtype 7"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}, "needs 16"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0.5, 16]}, "data_offsets"),
    ([1, 2], "JSON object"),
])
def test_malformed_header_entries_name_the_file_and_tensor(tmp_path, entry, why):
    from clover_lite.checkpoint.files import read_header

    f = tmp_path / "model.safetensors"
    _with_header(f, {"w": entry}, b"\0" * 32)
    with pytest.raises(CheckpointError, match="corrupt safetensors header") as e:
        read_header(f)
    assert "model.safetensors" in str(e.value) and "'w'" in str(e.value) and why in str(e.value)


def test_overlapping_tensors_and_a_non_object_header_are_refused(tmp_path):
    from clover_lite.checkpoint.files import read_header

    f = tmp_path / "model.safetensors"
    entries = {"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},  # inside a
               "c": {"dtype": "F32", "shape": [4], "data_offsets": [32, 48]}}
    _with_header(f, entries, b"\0" * 48)
    with pytest.raises(CheckpointError, match="'a' and 'b' overlap"):
        read_header(f)
    _with_header(f, [1, 2, 3], b"")
    with pytest.raises(CheckpointError, match="JSON object expected"):
        read_header(f)
    del entries["b"]  # the same header without the overlap reads, an unknown dtype included (read lazily)
    entries["d"] = {"dtype": "F8_E4M3", "shape": [3], "data_offsets": [48, 48]}
    _with_header(f, entries, b"\0" * 48)
    assert set(read_header(f)) == {"a", "c", "d"}


def test_mutated_headers_fail_with_our_error(ckpt):
    """A bounded fuzz: random bytes of the real header changed, deleted or inserted; every outcome is a
    header that reads or one CheckpointError, never another exception (a fresh seed each run, printed)."""
    from clover_lite.checkpoint.files import read_header

    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = data[8 : 8 + n], data[8 + n :]
    rng = random.Random(SEED)
    errors = 0
    for _ in range(300):
        h = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(h))
            op = rng.random()
            if op < 0.5:
                h[i] = rng.choice(b'0123456789{}[]",:-.eE ' + bytes([rng.randrange(256)]))
            elif op < 0.75:
                del h[i]
            else:
                h.insert(i, rng.randrange(256))
        f.write_bytes(struct.pack("<Q", len(h)) + bytes(h) + body)
        try:
            read_header(f)
        except CheckpointError:
            errors += 1
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"seed {SEED}: {type(e).__name__}: {e} for header {bytes(h)[:200]!r}") from e
    assert errors > 0, f"seed {SEED}: no mutation was refused"


def test_missing_weights_and_shards(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        _load(ckpt)
    sharded = write_tiny_checkpoint(tmp_path / "s", seed=1, max_shard_bytes=200_000)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="do not exist.*model-00002"):
        _load(sharded)


def test_non_float_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.zeros(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match="dtype I32"):
        _load(ckpt)


def test_config_errors(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())

    def write(c):
        (ckpt / "config.json").write_text(json.dumps(c))

    write({**cfg, "model_type": "llama"})
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        load_config(ckpt)
    write({k: v for k, v in cfg.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        load_config(ckpt)
    write({k: v for k, v in cfg.items() if k != "mask_token_id"})
    with pytest.raises(ConfigError, match="'mask_token_id'"):
        load_config(ckpt)
    write({**cfg, "layer_types": cfg["layer_types"][:2]})
    with pytest.raises(ConfigError, match="layer_types"):
        load_config(ckpt)
    write({**cfg, "num_experts_per_tok": 99})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(ckpt)
    (ckpt / "config.json").write_text('{"model_type": "clover_moe", ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load_config(ckpt)


def test_text_config_and_defaults():
    from clover_lite.models import config_from_dict

    text = {"vocab_size": 10, "hidden_size": 16, "num_hidden_layers": 8, "num_attention_heads": 2,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4, "linear_num_key_heads": 1,
            "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4}
    c = config_from_dict({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": True})
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert c.tie_word_embeddings and c.num_key_value_heads == 2 and c.head_dim == 8
    with pytest.raises(ConfigError, match="text_config"):
        config_from_dict({"model_type": "qwen3_5_moe", **text})


def test_the_official_clover_checkpoint_is_refused_never_run_as_the_backbone(ckpt):
    """model_type clover_moe with its own modeling code (auto_map) is the official checkpoint, whose
    block-diffusion parts are not public: load, info and run refuse it with one message naming what is not
    supported. Its extra GDN tensors, without the auto_map, are named as the official model's parts."""
    import clover_lite
    from clover_lite.cli.main import main as cli

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_clover.CloverConfig",
                       "AutoModelForCausalLM": "modeling_clover.CloverForCausalLM"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="official Clover checkpoint.*modeling_clover.CloverForCausalLM.*refuses"):
        clover_lite.load(ckpt, device="cpu")
    from click.testing import CliRunner

    for args in (["info", str(ckpt)], ["run", str(ckpt), "hi"]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code != 0 and "official Clover checkpoint" in r.output and "Traceback" not in r.output
    del cfg["auto_map"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.linear_attn.right_conv.weight": torch.zeros(8, 3)}))
    with pytest.raises(CheckpointError, match="right_conv.*official Clover checkpoint's block-diffusion GDN"):
        _load(ckpt)


def test_a_checkpoint_of_another_family_is_named(tmp_path):
    """An sdar config over LLaDA2 tensors (same vocabulary): the unexpected tensors are named as LLaDA2's."""
    from clover_lite.checkpoint.tiny_families import write_family_checkpoint

    sdar = write_family_checkpoint(tmp_path / "sdar", "sdar", num_hidden_layers=2)
    llada = write_family_checkpoint(tmp_path / "llada", "llada2", num_hidden_layers=2)
    vocab = json.loads((sdar / "config.json").read_text())["vocab_size"]
    tensors = {k: v for k, v in load_file(llada / "model.safetensors").items()}
    for k in ("model.word_embeddings.weight", "lm_head.weight"):
        if k in tensors:
            tensors[k] = tensors[k][:vocab]
    save_file(tensors, str(sdar / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="LLaDA2 .BailingMoeV2. names: is config.json's model_type llada2_moe"):
        _load(sdar)
