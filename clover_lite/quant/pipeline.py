"""`clover quantize`: stream a 16-bit checkpoint into an INT4 GPTQ one, one decoder layer at a time.

For each layer: read its tensors from the source, run the calibration activations through it collecting
input Hessians, quantize its linears (GPTQ or RTN), write its packed tensors to their own shard, run the
activations through the *quantized* layer (so later layers calibrate against quantized inputs), free it.
Peak host memory is about one layer plus the activations, whatever the depth.

Everything is written to `.OUT.partial` next to OUT and renamed into place at the end; the partial
directory keeps the finished layers' shards and the activations after them, so `resume=True` continues
from the last finished layer and produces byte-identical output.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from clover_lite.checkpoint.files import read_header
from clover_lite.checkpoint.load import Checkpoint, build_model, copy_tensors, plan_checkpoint
from clover_lite.checkpoint.names import canonical_name, model_name
from clover_lite.checkpoint.output import (
    OutputError,
    check_output,
    exclusive_writer,
    make_parents,
    owned_files,
    publish_directory,
    save_tensors,
    write_text_atomic,
)
from clover_lite.checkpoint.save import checkpoint_tensors
from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig, load_config
from clover_lite.models.denoiser import Denoiser, block_causal_mask
from clover_lite.models.diffusion_gemma_config import is_diffusion_gemma_dir
from clover_lite.models.moe import SparseMoE
from clover_lite.models.quantized import NF4Linear, QuantExperts, QuantLinear, gptq_experts, nf4_experts
from clover_lite.quant.calibration import calibration_ids, read_calibration_file, stdlib_texts, token_stream
from clover_lite.quant.checks import (
    SAFETENSORS_TO_TORCH,
    check_nf4_shapes,
    check_options,
    check_seqlen,
    check_shapes,
    layer_targets,
    linear_shapes,
    scan_finite,
)
from clover_lite.quant.gptq import HessianAccumulator, gptq_quantize, weighted_error
from clover_lite.quant.nf4 import quantize_nf4
from clover_lite.quant.options import QuantizationError, QuantizeOptions
from clover_lite.quant.rtn import QuantizedWeight, quantize_rtn
from clover_lite.tokenizer.tokenizer import Tokenizer, has_tokenizer_files

COPIED_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja",
                "special_tokens_map.json", "generation_config.json", "added_tokens.json", "vocab.json", "merges.txt")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass
class QuantizeReport:
    out: Path
    seconds: float
    bytes_before: int
    bytes_after: int
    error_by_kind: dict[str, float]
    fallback_experts: list[str]
    layers: list[dict] = field(default_factory=list)
    group_size: int | None = 128  # as used (the one chosen when the options left it open); None for NF4
    nf4_blocksize: int | None = None  # NF4's block (weights per absmax), as written to quantize_config.json


# ---- statistics -----------------------------------------------------------------------------------
class LayerStats:
    """Input Hessians of a layer's linears (per input group) and, for MoE, of every expert."""

    def __init__(self, layer: torch.nn.Module, options: QuantizeOptions, device: torch.device,
                 targets: list[tuple[str, str, str]] | None = None):
        """`targets`: the linears as layer_targets gives them (default: the Denoiser layer's own)."""
        self.layer, self.options, self.device = layer, options, device
        self.groups: dict[str, HessianAccumulator] = {}
        self.handles = []
        first = {}
        for name, _, group in (layer_targets(layer) if targets is None else targets):
            first.setdefault(group, name)
        for group, name in first.items():
            mod = layer.get_submodule(name)
            self.groups[group] = HessianAccumulator(mod.in_features, device)
            self.handles.append(mod.register_forward_pre_hook(self._hook(group)))
        self.experts_in: list[HessianAccumulator] = []
        self.experts_down: list[HessianAccumulator] = []
        self.routed = None
        if isinstance(layer.mlp, SparseMoE):
            self.handles.append(layer.mlp.register_forward_pre_hook(self._moe_hook))

    def _hook(self, group: str):
        def hook(module, args):
            self.groups[group].add(args[0])

        return hook

    def _moe_hook(self, module: SparseMoE, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        _, ids = module.gate(x)
        self.add_experts(x, ids, module.experts.gate_up_proj, F.silu)

    def add_experts(self, x: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                    activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The experts' statistics from their input x [T, hidden] routed to ids [T, k]: the input Hessian
        (shared, or per expert from its routed tokens) and each expert's down-projection input,
        activation(gate) * up, from every token ("all") or its routed ones."""
        E, inter = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
        if not self.experts_down:
            per_expert_in = self.options.moe_calibration == "routed"
            self.experts_in = [HessianAccumulator(x.shape[1], self.device) for _ in range(E if per_expert_in else 1)]
            self.experts_down = [HessianAccumulator(inter, self.device) for _ in range(E)]
            self.routed = torch.zeros(E, dtype=torch.long)
        self.routed += torch.bincount(ids.reshape(-1).cpu(), minlength=E)
        if self.options.moe_calibration == "all":
            self.experts_in[0].add(x)  # every expert sees every token: one shared Hessian
        for e in range(E):
            if self.options.moe_calibration == "routed":
                rows = (ids == e).any(-1)
                xe = x[rows]
                self.experts_in[e].add(xe)
            else:
                xe = x
            gate, up = F.linear(xe, gate_up_proj[e]).chunk(2, dim=-1)
            self.experts_down[e].add(activation(gate) * up)

    def expert_in(self, e: int) -> HessianAccumulator:
        return self.experts_in[e] if len(self.experts_in) > 1 else self.experts_in[0]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# ---- quantizing -----------------------------------------------------------------------------------
def quantize_weight(w: torch.Tensor, H: torch.Tensor, options: QuantizeOptions) -> QuantizedWeight:
    """One linear [N, K] or a batch of them [E, N, K] (H [K, K] shared or [E, K, K])."""
    if options.method == "gptq":
        return gptq_quantize(w, H, options.spec, options.damp_percent, options.act_order, options.static_groups)
    return quantize_rtn(w, options.spec)


def quant_linear(qw: QuantizedWeight, options: QuantizeOptions, device: torch.device) -> QuantLinear:
    packed = qw.pack(options.checkpoint_format)
    N, K = qw.q.shape
    mod = QuantLinear(K, N, packed["scales"].shape[0], checkpoint_format=options.checkpoint_format).to(device)
    for k, v in packed.items():
        getattr(mod, k).copy_(v)
    return mod


def quantize_layer(layer: torch.nn.Module, stats: LayerStats, options: QuantizeOptions, index: int,
                   device: torch.device) -> tuple[dict, list[str]]:
    """Swap the layer's linears for quantized ones in place; returns (mean relative output error per kind,
    experts that fell back to RTN)."""
    errors = quantize_linears(layer, layer_targets(layer), stats, options, device)
    fallbacks = []
    if isinstance(layer.mlp, SparseMoE):
        layer.mlp.experts, fallbacks = quantize_experts(layer.mlp.experts, stats, options, device,
                                                        f"layers.{index}.mlp.experts", errors)
    summary = {kind: sum(v) / len(v) for kind, v in errors.items() if v}
    return summary, fallbacks


def quantize_linears(layer: torch.nn.Module, targets: list[tuple[str, str, str]], stats: LayerStats,
                     options: QuantizeOptions, device: torch.device) -> dict[str, list[float]]:
    """Swap each target linear of `layer` for its QuantLinear (GPTQ against its input group's Hessian, or
    RTN); returns the relative output errors by kind."""
    errors: dict[str, list[float]] = {}
    for name, kind, group in targets:
        lin = layer.get_submodule(name)
        H = stats.groups[group].H
        w = lin.weight.data.float()
        qw = quantize_weight(w, H, options)
        errors.setdefault(kind, []).append(float(weighted_error(w, qw.dequantize(), H)))
        parent, _, child = name.rpartition(".")
        setattr(layer.get_submodule(parent), child, quant_linear(qw, options, device))
    return errors


def quantize_experts(ex: torch.nn.Module, stats: LayerStats, options: QuantizeOptions, device: torch.device,
                     name: str, errors: dict[str, list[float]], activation: str = "silu"
                     ) -> tuple[QuantExperts, list[str]]:
    """The QuantExperts of fused float experts `ex` (gate_up_proj [E, 2I, H], down_proj [E, H, I]) named
    `name`, from the statistics' Hessians (experts with fewer than min_expert_samples routed tokens on RTN);
    appends their errors under "experts" and returns the experts that fell back."""
    E, inter, hidden = ex.gate_up_proj.shape[0], ex.gate_up_proj.shape[1] // 2, ex.gate_up_proj.shape[2]
    starved = [e for e in range(E) if stats.expert_in(e).n < options.min_expert_samples]
    fallbacks = [f"{name}.{e}" for e in starved]
    # Hessians stacked a chunk at a time: all 256 of a routed calibration at hidden 2048 are 4 GiB,
    # and a stack of them would be another 4 GiB on the device.
    H_in = [h.H for h in stats.experts_in]  # one shared, or one per expert (routed calibration)
    H_down = [h.H for h in stats.experts_down]
    spec = options.spec
    q = gptq_experts(E, hidden, inter, spec.groups(hidden), spec.groups(inter), options.checkpoint_format,
                     activation)
    q = q.to(device)
    weights = {"gate_proj": (ex.gate_up_proj[:, :inter], H_in), "up_proj": (ex.gate_up_proj[:, inter:], H_in),
               "down_proj": (ex.down_proj, H_down)}
    chunk = options.expert_chunk
    for part, (w_all, H_all) in weights.items():
        # Experts in chunks: one batched GPTQ call per chunk amortises the column loop while the
        # temporaries stay a few experts big, whatever the expert count.
        for s in range(0, E, chunk):
            ids = list(range(s, min(s + chunk, E)))
            w = w_all[s : s + len(ids)].detach().float()
            H = H_all[0][None] if len(H_all) == 1 else torch.stack(H_all[s : s + len(ids)])  # shared: a view
            qw = quantize_weight(w, H, options)
            weak = [j for j, e in enumerate(ids) if e in starved]
            if weak:  # too few calibration samples for a Hessian worth trusting
                rtn = quantize_rtn(w[weak], spec)
                for t in ("q", "scales", "zeros", "g_idx"):
                    getattr(qw, t)[weak] = getattr(rtn, t).to(getattr(qw, t).dtype)
            err = weighted_error(w, qw.dequantize(), H)
            errors.setdefault("experts", []).extend(
                float(err[j]) for j, e in enumerate(ids) if stats.expert_in(e).n and e not in starved
            )
            for j, e in enumerate(ids):
                for k, v in qw[j].pack(options.checkpoint_format).items():
                    getattr(getattr(q, part), k)[e].copy_(v)
    return q, fallbacks


def quantize_layer_nf4(layer: torch.nn.Module, options: QuantizeOptions, device: torch.device) -> None:
    """The NF4 baseline: every target linear and expert through bitsandbytes, no calibration."""
    bs = options.nf4_blocksize
    for name, _, _ in layer_targets(layer):
        lin = layer.get_submodule(name)
        mod = NF4Linear(lin.in_features, lin.out_features, bs).to(device)
        packed, absmax = quantize_nf4(lin.weight.data, bs)
        mod.nf4_weight.copy_(packed)
        mod.nf4_absmax.copy_(absmax)
        parent, _, child = name.rpartition(".")
        setattr(layer.get_submodule(parent), child, mod)
    if isinstance(layer.mlp, SparseMoE):
        ex = layer.mlp.experts
        E, inter, hidden = ex.gate_up_proj.shape[0], ex.gate_up_proj.shape[1] // 2, ex.gate_up_proj.shape[2]
        q = nf4_experts(E, hidden, inter, bs).to(device)
        for e in range(E):
            for part, w in (("gate_proj", ex.gate_up_proj[e, :inter]), ("up_proj", ex.gate_up_proj[e, inter:]),
                            ("down_proj", ex.down_proj[e])):
                packed, absmax = quantize_nf4(w.data, bs)
                getattr(q, part).nf4_weight[e].copy_(packed)
                getattr(q, part).nf4_absmax[e].copy_(absmax)
        layer.mlp.experts = q


# ---- the pipeline ---------------------------------------------------------------------------------
def save_layer(partial: Path, i: int, n_shards: int, tensors: dict[str, torch.Tensor], acts, acts_file: Path,
               state: dict, state_file: Path, entry: dict) -> None:
    """Layer i made durable: its shard, the activations the next layer starts from (None: none kept), then the
    state that records it, each written atomically, in that order: a crash between them redoes layer i."""
    _atomic_save_file(tensors, partial / f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors")
    if acts is not None:
        tmp = acts_file.with_name("activations.pt.tmp")
        try:
            torch.save(acts, tmp)
        except RuntimeError as e:  # torch's writer reports a failed write (a full disk) as a RuntimeError
            tmp.unlink(missing_ok=True)
            raise OSError(errno.EIO, f"{e}".splitlines()[0], str(tmp)) from e
        os.replace(tmp, acts_file)
    state["layers"].append(entry)
    state["next_layer"] = i + 1
    write_text_atomic(state_file, json.dumps(state))


def _atomic_save_file(tensors: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_tensors(tensors, tmp)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _check_finite(t: torch.Tensor, what: str) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise QuantizationError(f"{what} contains NaN or Inf values; the source checkpoint or calibration is broken")


def calibration_stream(src: Path, eos_token_ids, options: QuantizeOptions) -> tuple[Tokenizer, torch.Tensor]:
    """The model's tokenizer and the calibration text as one token stream (documents joined by the first EOS
    id of the config, else of the tokenizer)."""
    if not has_tokenizer_files(src):
        raise QuantizationError(f"{src}: no tokenizer files; calibration needs the model's tokenizer")
    tokenizer = Tokenizer.from_dir(src)
    texts = read_calibration_file(options.calib) if options.calib else stdlib_texts(seed=options.seed)
    eos = (list(eos_token_ids) + tokenizer.eos_token_ids + [None])[0]
    # Four windows' worth of text per sample keeps the windows varied without tokenizing megabytes.
    return tokenizer, token_stream(tokenizer, texts, eos, max_tokens=4 * options.nsamples * options.seqlen)


def calibration_batch(src: Path, config: ModelConfig, options: QuantizeOptions, block_size: int) -> torch.Tensor:
    tokenizer, stream = calibration_stream(src, config.eos_token_ids, options)
    mask = config.mask_token_id if config.mask_token_id is not None else tokenizer.mask_token_id
    return calibration_ids(stream, options.nsamples, options.seqlen, options.seed, options.calibration,
                           block_size, mask)


def _run_layer(layer, acts: torch.Tensor, model: Denoiser, cos, sin, mask, batch: int) -> torch.Tensor:
    out = torch.empty_like(acts)
    with torch.no_grad():
        for s in range(0, acts.shape[0], batch):
            x = acts[s : s + batch]
            state = model.zero_gdn_state(x.shape[0], x) if layer.kind == "linear_attention" else None
            out[s : s + batch], _ = layer(x, cos, sin, mask, None, state)
    return out


PARTIAL_MARKER = ".clover-lite-partial"  # in `.OUT.partial`: what says it is ours to resume or remove
STATE_FILE, ACTS_FILE = "state.json", "activations.pt"  # there too: the finished layers, the next one's input

# A family's layer walk, as its preparation gives it: run(out, options, t0, partial, state, on_layer).
Run = Callable[[Path, QuantizeOptions, float, Path, "dict | None", "Callable[[int, int, dict], None] | None"],
               QuantizeReport]
# Its preparation: prepare(src, options) -> (options with the group size chosen, bytes needed, run).
Prepare = Callable[[Path, QuantizeOptions], tuple[QuantizeOptions, int, Run]]


def quantize_model(
    src: str | os.PathLike,
    out: str | os.PathLike,
    options: QuantizeOptions = QuantizeOptions(),
    force: bool = False,
    resume: bool = False,
    on_layer: Callable[[int, int, dict], None] | None = None,
    restart: bool = False,
    prepare: Prepare | None = None,
) -> QuantizeReport:
    """Quantize the checkpoint at `src` into `out` (see the module docstring).

    An unfinished run of the same command (its `.OUT.partial`) is continued with `resume`, or discarded
    with `restart`; with neither it is refused, so finished layers are never thrown away silently.
    `force` replaces an earlier output of ours at `out`, and nothing else (checkpoint/output.py).
    `prepare` checks the source and gives the layer walk of another family (a DiffusionGemma source:
    quant/diffusion_gemma.quantize_diffusion_gemma passes its own); default: the block denoisers'."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    options = check_options(options)
    if resume and restart:
        raise QuantizationError("--resume continues the unfinished run and --restart discards it: pass one")
    # Before anything is read or written: OUT must not hold someone else's files nor touch the source.
    check_output(out, sources=[src], force=force)
    if prepare is None and is_diffusion_gemma_dir(src):
        raise QuantizationError(f"{src}: a DiffusionGemma checkpoint has its own layer walk: quantize it with "
                                "clover_lite.quant.diffusion_gemma.quantize_diffusion_gemma (what `clover quantize` "
                                "runs for it)")
    options, needed, run = (prepare or _prepare)(src, options)
    partial = partial_dir(out)
    # A resumed run's finished layers (and its activations, rewritten in place) are already on the disk.
    held = sum(f.stat().st_size for f in partial.iterdir() if f.is_file()) if resume and partial.is_dir() else 0
    check_output(out, sources=[src], force=force, needed_bytes=max(0, needed - held))
    with exclusive_writer(out, "clover quantize"):
        return _run_in_partial(src, out, options, partial, run, t0, resume, restart, on_layer)


def partial_dir(out: Path) -> Path:
    """Where a quantization writes until it is published at OUT (and where --resume finds it)."""
    return out.parent / f".{out.name}.partial"


def _run_in_partial(src: Path, out: Path, options: QuantizeOptions, partial: Path, run: Run, t0: float,
                    resume: bool, restart: bool, on_layer) -> QuantizeReport:
    """quantize_model's run in `.OUT.partial`, while it holds OUT's lock: a new partial or the unfinished one,
    and what a failure keeps of it."""
    # Ours: an unfinished run, or the old output a replacement swapped out just before a crash.
    ours = (partial / PARTIAL_MARKER).exists() or owned_files(partial) is not None
    if partial.exists() and not ours and any(partial.iterdir()):
        raise QuantizationError(f"{partial} exists and clover-lite did not write it; move it away (nothing "
                                "was changed)")
    state = unfinished_run(partial, src, options, resume, restart)
    if state is None:
        if partial.exists():
            shutil.rmtree(partial)
        make_parents(out)
        try:
            partial.mkdir()
            (partial / PARTIAL_MARKER).touch()
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise QuantizationError(f"cannot write {out}: {e.strerror or e} in {out.parent}; choose a "
                                    "directory you can write to") from e
    try:
        return run(out, options, t0, partial, state, on_layer)
    except OutputError as e:  # a write failed (a full disk): the finished layers stay for --resume
        raise QuantizationError(f"{e}; the finished layers are kept in {partial}: fix that and rerun with "
                                "--resume") from e
    except CloverError:
        # Bad input (NaN weights, a broken source): resuming would fail the same way, so nothing is kept.
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as e:  # a full disk, a vanished directory: the finished layers stay for --resume
        raise QuantizationError(f"writing {out} failed: {e.strerror or e} ({e.filename or partial}); the "
                                f"finished layers are kept in {partial}: fix that and rerun with --resume") from e


def _prepare(src: Path, options: QuantizeOptions) -> tuple[QuantizeOptions, int, Run]:
    """A block denoiser's checkpoint checked from its headers: (options with the group size chosen, bytes
    the output and the kept activations need, the run)."""
    config = load_config(src)
    ckpt = Checkpoint(src)
    if ckpt.quant_config is not None:
        raise QuantizationError(f"{src} is already quantized; quantize from the 16-bit checkpoint")
    check_seqlen(options, config.max_position_embeddings)
    device = torch.device(options.device)
    model = build_model(config, device, torch.float32, materialize=False)  # all on meta: nothing allocated
    plans, _, _ = plan_checkpoint(model, ckpt)  # validates the whole checkpoint from its headers
    if options.quantize_lm_head and config.tie_word_embeddings:
        raise QuantizationError("--quantize-lm-head: this model ties lm_head to its embeddings "
                                "(tie_word_embeddings), which stay 16-bit; leave the flag out")
    if options.method == "nf4":
        check_nf4_shapes(linear_shapes(model, options), options.nf4_blocksize)
    else:
        options = check_shapes(model, options)
    scan_finite(ckpt.headers[name] for name in plans)  # what the model reads, scanned as load scans it
    # About the packed layers plus the 16-bit rest, and the activations kept for --resume.
    src_bytes = sum(f.stat().st_size for f in ckpt.files)
    acts_bytes = 0 if options.method == "nf4" else 4 * options.nsamples * options.seqlen * config.hidden_size

    def run(out, opts, t0, partial, state, on_layer):
        return _quantize_into(src, out, opts, t0, config, ckpt, model, plans, partial, state, on_layer)

    return options, src_bytes // 3 + acts_bytes, run


def source_files(src: Path) -> str:
    """What identifies the source's contents for --resume without reading them: each file's name, size and
    modification time."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in src.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def _new_state(src: Path, options: QuantizeOptions) -> dict:
    return {"fingerprint": options.fingerprint(), "source": str(src.resolve()), "source_files": source_files(src),
            "next_layer": 0, "layers": []}


def unfinished_run(partial: Path, src: Path, options: QuantizeOptions, resume: bool, restart: bool) -> dict | None:
    """The state of the unfinished run to continue, or None to start afresh; raise when continuing or
    discarding it is the user's choice to make."""
    state_file = partial / STATE_FILE
    if not partial.exists() or restart:
        return None
    try:
        state = json.loads(state_file.read_text())
        done = int(state["next_layer"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # killed before its first layer finished: nothing to lose
    same = state.get("fingerprint") == options.fingerprint() and state.get("source") == str(src.resolve())
    done = f"{done} layer{'' if done == 1 else 's'}"
    if resume and same and state.get("source_files") != source_files(src):
        raise QuantizationError(
            f"the source {src} changed since the unfinished run in {partial} began ({done} done), so its "
            "finished layers no longer match it: pass --restart to quantize the source as it is now")
    if resume and same:
        return state
    if resume:
        raise QuantizationError(
            f"the unfinished run in {partial} ({done} done) used another source or other settings: "
            "rerun with its settings and --resume to continue it, or pass --restart to discard it")
    raise QuantizationError(
        f"an unfinished run of this quantization is in {partial} ({done} done): pass --resume to "
        "continue it" + ("" if same else " (it used other settings than these)")
        + ", or --restart to discard it and start again")


def _quantize_into(src: Path, out: Path, options: QuantizeOptions, t0: float, config: ModelConfig,
                   ckpt: Checkpoint, model: Denoiser, plans, partial: Path, state: dict | None,
                   on_layer: Callable[[int, int, dict], None] | None) -> QuantizeReport:
    device = torch.device(options.device)
    block = options.block_size or config.block_size or 4
    n_layers = config.num_hidden_layers
    n_shards = n_layers + 1
    embed = {model_name(n, config): info for n, info in ckpt.canonical().items()}["embed_tokens.weight"]
    src_dtype = SAFETENSORS_TO_TORCH.get(embed.dtype, torch.bfloat16)
    state_file, acts_file = partial / STATE_FILE, partial / ACTS_FILE

    L = options.seqlen
    cos, sin = model.rotary(torch.arange(L, device=device))
    mask = block_causal_mask(0, L, block, device)
    nf4 = options.method == "nf4"
    if state is None and nf4:
        acts = None  # NF4 needs no calibration
        state = _new_state(src, options)
    elif state is None:
        ids = calibration_batch(src, config, options, block).to(device)
        model.embed_tokens.to_empty(device=device)
        copy_tensors(model, ckpt, plans, only=lambda n: n == "embed_tokens.weight")
        with torch.no_grad():
            acts = model.embed_tokens(ids).float()
        model.embed_tokens.to(device="meta")
        state = _new_state(src, options)
    else:
        acts = None if nf4 else torch.load(acts_file, map_location=device)

    fallbacks = [f for entry in state["layers"] for f in entry["fallback_experts"]]
    for i in range(state["next_layer"], n_layers):
        lt = time.perf_counter()
        layer = model.layers[i].to_empty(device=device)
        prefix = f"layers.{i}."
        copy_tensors(model, ckpt, plans, only=lambda n, p=prefix: n.startswith(p))  # scanned in _prepare
        if nf4:
            quantize_layer_nf4(layer, options, device)
            summary, layer_fallbacks = {}, []
        else:
            stats = LayerStats(layer, options, device)
            _run_layer(layer, acts, model, cos, sin, mask, options.batch_size)  # collects the Hessians
            stats.close()
            summary, layer_fallbacks = quantize_layer(layer, stats, options, i, device)
            del stats
            acts = _run_layer(layer, acts, model, cos, sin, mask, options.batch_size)
            _check_finite(acts, f"the output of layer {i} on the calibration data")
        tensors = dict(checkpoint_tensors(layer, dtype=src_dtype, prefix=prefix))
        entry = {"layer": i, "kind": "attention" if layer.kind == "full_attention" else "gdn",
                 "errors": summary, "fallback_experts": layer_fallbacks}
        model.layers[i] = torch.nn.Identity()  # free it
        save_layer(partial, i, n_shards, tensors, acts, acts_file, state, state_file, entry)
        fallbacks += layer_fallbacks
        if on_layer:
            on_layer(i, n_layers, {**entry, "seconds": time.perf_counter() - lt})
        del layer, tensors  # before the next layer is allocated: one layer on the device at a time

    # The last shard: embeddings, final norm, lm_head (16-bit unless quantize_lm_head).
    last: dict[str, torch.Tensor] = {}
    lm_head_error = None
    for name, info in ckpt.headers.items():
        canon = canonical_name(name)
        if canon is None or canon.startswith("layers."):
            continue
        if canon == "lm_head.weight" and config.tie_word_embeddings:
            continue
        with safe_open(str(info.file), framework="pt", device="cpu") as f:
            last[f"model.{canon}" if canon != "lm_head.weight" else canon] = f.get_tensor(name)
    if options.quantize_lm_head and nf4:
        # On the device the layers used (bitsandbytes' CPU path is slow on a 248K-row lm_head); results to host.
        last["lm_head.nf4_weight"], last["lm_head.nf4_absmax"] = quantize_nf4(last.pop("lm_head.weight").to(device),
                                                                              options.nf4_blocksize)
    elif options.quantize_lm_head:
        lm_head_error = _quantize_lm_head(model, ckpt, plans, acts, last, options, device, config)
    return finish_run(partial, out, src, config, options, state, fallbacks, block, n_shards, last, lm_head_error,
                      sum(f.stat().st_size for f in ckpt.files), t0)


def finish_run(partial: Path, out: Path, src: Path, config: ModelConfig | None, options: QuantizeOptions,
               state: dict, fallbacks: list[str], block: int | None, n_shards: int, last: dict[str, torch.Tensor],
               lm_head_error: float | None, bytes_before: int, t0: float, extra: dict | None = None
               ) -> QuantizeReport:
    """After the last layer: the last shard (`last`: what no layer shard holds), the metadata, the run's own
    files removed, the directory published in place of OUT; the report."""
    _atomic_save_file(last, partial / f"model-{n_shards:05d}-of-{n_shards:05d}.safetensors")
    error_by_kind = _mean_errors(state["layers"], lm_head_error)
    _write_metadata(partial, src, config, options, state["layers"], error_by_kind, fallbacks, block, n_shards, extra)
    for f in (partial / STATE_FILE, partial / ACTS_FILE, partial / PARTIAL_MARKER):
        f.unlink(missing_ok=True)
    publish_directory(partial, out, "quantized")
    return QuantizeReport(
        out=out,
        seconds=time.perf_counter() - t0,
        bytes_before=bytes_before,
        bytes_after=sum(f.stat().st_size for f in out.glob("*.safetensors")),
        error_by_kind=error_by_kind,
        fallback_experts=fallbacks,
        layers=state["layers"],
        group_size=None if options.method == "nf4" else options.group_size,
        nf4_blocksize=options.nf4_blocksize if options.method == "nf4" else None,
    )


def _quantize_lm_head(model, ckpt, plans, acts, last, options, device, config) -> float:
    model.norm.to_empty(device=device)
    copy_tensors(model, ckpt, plans, only=lambda n: n == "norm.weight")
    H = HessianAccumulator(config.hidden_size, device)
    with torch.no_grad():
        for s in range(0, acts.shape[0], options.batch_size):
            H.add(model.norm(acts[s : s + options.batch_size]))
    w = last.pop("lm_head.weight").float().to(device)
    qw = quantize_weight(w, H.H, options)
    for k, v in qw.pack(options.checkpoint_format).items():
        last[f"lm_head.{k}"] = v.cpu()
    return float(weighted_error(w, qw.dequantize(), H.H))


def _mean_errors(layers: list[dict], lm_head_error: float | None) -> dict[str, float]:
    by_kind: dict[str, list[float]] = {}
    for entry in layers:
        for kind, err in entry["errors"].items():
            by_kind.setdefault(kind, []).append(err)
    out = {kind: sum(v) / len(v) for kind, v in by_kind.items()}
    if lm_head_error is not None:
        out["lm_head"] = lm_head_error
    return out


def _quant_config(options: QuantizeOptions) -> dict:
    """The standard keys other tools read (GPTQ's quantize_config.json), or ours for NF4."""
    if options.method == "nf4":
        return {"quant_method": "nf4", "bits": 4, "blocksize": options.nf4_blocksize,
                "lm_head": options.quantize_lm_head}
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": options.group_size,
        "desc_act": options.act_order and options.method == "gptq",
        "sym": options.sym,
        "damp_percent": options.damp_percent,
        "static_groups": options.static_groups,
        "true_sequential": False,
        "checkpoint_format": options.checkpoint_format,
        "lm_head": options.quantize_lm_head,
    }


def _write_metadata(partial: Path, src: Path, config: ModelConfig | None, options: QuantizeOptions,
                    layers: list[dict], error_by_kind: dict, fallbacks: list[str], block: int | None, n_shards: int,
                    extra: dict | None = None) -> None:
    """The index, quantize_config.json (the standard keys and ours under "clover": `extra` added, no
    block_size when `block` is None), config.json with its quantization_config, and the tokenizer files."""
    weight_map, total = {}, 0
    for i in range(1, n_shards + 1):
        fname = f"model-{i:05d}-of-{n_shards:05d}.safetensors"
        for name, info in read_header(partial / fname).items():
            weight_map[name] = fname
            total += DTYPE_BYTES[info.dtype] * math.prod(info.shape)
    write_text_atomic(partial / "model.safetensors.index.json",
                  json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    quant = _quant_config(options)
    clover = {
        "method": options.method,
        "calibration": options.calibration,
        "calibration_text": options.calib or "python standard library sources",
        "moe_calibration": options.moe_calibration,
        "min_expert_samples": options.min_expert_samples,
        "nsamples": options.nsamples,
        "seqlen": options.seqlen,
        "seed": options.seed,
        "block_size": block,
        "relative_output_error": error_by_kind,
        "layers": layers,
        "rtn_fallback_experts": fallbacks,
        **(extra or {}),
    }
    if block is None:
        del clover["block_size"]
    write_text_atomic(partial / "quantize_config.json", json.dumps({**quant, "clover": clover}, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant
    write_text_atomic(partial / "config.json", json.dumps(cfg, indent=2))
    for name in COPIED_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, partial / name)
