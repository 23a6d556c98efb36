"""`clover quantize` for DiffusionGemma: GPTQ or RTN INT4, one layer at a time (docs/ARCHITECTURE.md sections 3
and 11).

`quantize_diffusion_gemma` runs quant/pipeline.quantize_model with this module's preparation and layer walk,
which are the pipeline's own (Hessians per input group, experts quantized together with the same
fallback to RTN, the quantized layer re-run so the next one calibrates on quantized inputs, a shard per layer
in `.OUT.partial`, `--resume`, the atomic publish of checkpoint/output.py); what differs is what a layer sees.
Released checkpoints tie the encoder to the decoder (models/diffusion_gemma.py: one set of weights), so each
layer's linears serve two kinds of input, and the calibration feeds both:

- the encoder, causally over text: each calibration window's first `seqlen - C` tokens (BOS first), whose
  keys and values at each layer form the prefix cache, sliding layers keeping their window as at run time;
- the decoder, one denoising step over a canvas of the window's last C tokens (C = canvas_length, at most
  seqlen / 2) that reads that prefix. As the sampler renoises, each canvas has a share of its positions
  (spread from 0.1 to 1.0 over the samples, `--calibration diffusion`) replaced by uniform random tokens, and
  it is self-conditioned on the clean text's embeddings, which stand in for the previous step's prediction
  (the limit of a confident step); a fully random canvas is a first step and has no self-conditioning.
  `--calibration clean`: clean canvases, no self-conditioning.

An untied checkpoint's encoder layers get the encoder's statistics and its decoder layers the decoder's. Every
layer's attention (q/k/v/o; full layers have no v), dense GELU MLP and routed GELU experts become INT4 (all
calibration tokens through every expert for the experts' Hessians by default, as for the block denoisers);
embeddings, norms, the router, the layer scalars, the self-conditioning MLP (once per step, 0.07% of the
weights) and the vision tower stay as stored. The experts are written per expert
(`model.decoder.layers.N.experts.E.gate_proj.qweight`, ...), the layout checkpoint/diffusion_gemma_weights.py
reads back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from clover_lite.checkpoint.diffusion_gemma_weights import (
    _skip_reason,
    build_model,
    copy_weights,
    plan_weights,
    read_headers,
    tensor_names,
)
from clover_lite.checkpoint.load import read_quant_config
from clover_lite.checkpoint.save import checkpoint_tensors
from clover_lite.models.diffusion_gemma import DiffusionGemma, GemmaLayer, encoder_mask
from clover_lite.models.diffusion_gemma_config import DiffusionGemmaConfig, load_diffusion_gemma_config
from clover_lite.models.layers import ACTIVATIONS
from clover_lite.quant.calibration import calibration_ids
from clover_lite.quant.checks import SAFETENSORS_TO_TORCH, check_linear_shapes, check_seqlen, scan_finite
from clover_lite.quant.options import QuantizationError, QuantizeOptions
from clover_lite.quant.pipeline import (
    ACTS_FILE,
    STATE_FILE,
    LayerStats,
    QuantizeReport,
    Run,
    _check_finite,
    _new_state,
    calibration_stream,
    finish_run,
    quantize_experts,
    quantize_linears,
    quantize_model,
    save_layer,
)


def layer_targets(layer: GemmaLayer) -> list[tuple[str, str, str]]:
    """(module name, kind, input group) of the layer's linears to quantize (pipeline.layer_targets' form)."""
    qkv = ("q_proj", "k_proj") + (("v_proj",) if layer.self_attn.v_proj is not None else ())
    return ([(f"self_attn.{n}", "attention", "attn_in") for n in qkv] + [("self_attn.o_proj", "attention", "attn_out")]
            + [(f"mlp.{n}", "dense", "mlp_in") for n in ("gate_proj", "up_proj")]
            + [("mlp.down_proj", "dense", "dense_down")])


def stacks(model: DiffusionGemma) -> list[tuple[str, str]]:
    """(our name, checkpoint name) of each stack's layer list: the decoder's, and the encoder's if untied."""
    out = [("decoder.layers", "decoder.layers")]
    return out if model.encoder is None else [("encoder.layers", "encoder.language_model.layers"), *out]


def linear_shapes(model: DiffusionGemma) -> dict[str, tuple[int, int]]:
    """(out, in) features of every linear to quantize, by name (experts once per layer)."""
    c, shapes = model.config, {}
    for ours, _ in stacks(model):
        for i, layer in enumerate(model.get_submodule(ours)):
            for name, _, _ in layer_targets(layer):
                lin = layer.get_submodule(name)
                shapes[f"{ours}.{i}.{name}"] = (lin.out_features, lin.in_features)
            shapes[f"{ours}.{i}.experts.*.gate_proj"] = (c.moe_intermediate_size, c.hidden_size)
            shapes[f"{ours}.{i}.experts.*.down_proj"] = (c.hidden_size, c.moe_intermediate_size)
    return shapes


def canvas_split(config: DiffusionGemmaConfig, seqlen: int) -> tuple[int, int]:
    """(prompt, canvas) lengths of a calibration window of `seqlen` tokens."""
    if seqlen < 2:
        raise QuantizationError(f"--seqlen {seqlen} is too short: a DiffusionGemma calibration window is a prompt "
                                "and a canvas (at least 2 tokens)")
    C = min(config.canvas_length, seqlen // 2)
    return seqlen - C, C


def quantize_diffusion_gemma(src: str | os.PathLike, out: str | os.PathLike, options: QuantizeOptions | None = None,
                             force: bool = False, resume: bool = False,
                             on_layer: Callable[[int, int, dict], None] | None = None,
                             restart: bool = False) -> QuantizeReport:
    """`clover quantize` on a DiffusionGemma checkpoint: pipeline.quantize_model (its checks, partial directory,
    resume and publish) with this module's layer walk."""
    return quantize_model(src, out, options or QuantizeOptions(), force=force, resume=resume, on_layer=on_layer,
                          restart=restart, prepare=prepare_diffusion_gemma)


def prepare_diffusion_gemma(src: Path, options: QuantizeOptions) -> tuple[QuantizeOptions, int, Run]:
    """Check the checkpoint from its headers and the options against it: (options with the group size chosen,
    bytes needed, the run) for pipeline.quantize_model."""
    if options.method not in ("gptq", "rtn"):
        raise QuantizationError(f"--method {options.method} is not supported for DiffusionGemma; use gptq or rtn "
                                "(INT4 in the GPTQ format)")
    if options.quantize_lm_head:
        raise QuantizationError("--quantize-lm-head does not apply to DiffusionGemma: its output layer is read as "
                                "a plain weight (the embeddings, which the self-conditioning also reads, when tied "
                                "as released) and stays 16-bit; leave the flag out")
    config = load_diffusion_gemma_config(src)
    check_seqlen(options, config.max_position_embeddings)
    headers, files = read_headers(src)
    if read_quant_config(src) is not None:
        raise QuantizationError(f"{src} is already quantized; quantize from the 16-bit checkpoint")
    model = build_model(config, torch.float32, headers, None, src)  # on meta: nothing allocated
    plan, files, _ = plan_weights(model, src, headers)  # validates the whole checkpoint from its headers
    options = check_linear_shapes(linear_shapes(model), options)
    canvas_split(config, options.seqlen)
    scan_finite(plan.values())  # before any layer is quantized, as the block denoisers' sources are
    src_bytes = sum(f.stat().st_size for f in files)
    acts_bytes = 4 * options.nsamples * options.seqlen * config.hidden_size

    def run(out, opts, t0, partial, state, on_layer):
        return _quantize_into(src, out, opts, t0, config, model, headers, plan, partial, state, on_layer)

    return options, src_bytes // 3 + acts_bytes, run


def calibration_canvases(src: Path, config: DiffusionGemmaConfig, options: QuantizeOptions
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompts [n, P], clean canvases [n, C], the canvases as the decoder sees them [n, C], which samples
    are self-conditioned [n] bool) from the calibration text (see the module docstring)."""
    _, stream = calibration_stream(src, config.eos_token_ids, options)
    ids = calibration_ids(stream, options.nsamples, options.seqlen, options.seed, "clean")
    P, C = canvas_split(config, options.seqlen)
    prompts, clean = ids[:, :P].clone(), ids[:, P:]
    if config.bos_token_id is not None and 0 <= config.bos_token_id < config.vocab_size:
        prompts[:, 0] = config.bos_token_id  # every conversation starts with BOS: the encoder never sees otherwise
    n = ids.shape[0]
    if options.calibration == "clean":
        return prompts, clean, clean.clone(), torch.zeros(n, dtype=torch.bool)
    gen = torch.Generator().manual_seed(options.seed + 1)
    ratios = torch.linspace(0.1, 1.0, n)[torch.randperm(n, generator=gen)]
    noisy = clean.clone()
    for i in range(n):
        pos = torch.randperm(C, generator=gen)[: max(1, round(float(ratios[i]) * C))]
        noisy[i, pos] = torch.randint(0, config.vocab_size, (len(pos),), generator=gen)
    return prompts, clean, noisy, ratios < 1.0


class _Walk:
    """What every layer's forward needs: RoPE for the prompt and canvas positions, the encoder's causal mask
    per layer kind, the layer scalars, the window sliding layers keep."""

    def __init__(self, model: DiffusionGemma, P: int, C: int, scalars: dict[str, torch.Tensor],
                 device: torch.device, batch: int):
        c = model.config
        self.config, self.batch, self.scalars = c, batch, scalars
        self.rope_enc = model._cos_sin(torch.arange(P, device=device))
        self.rope_dec = model._cos_sin(torch.arange(P, P + C, device=device))
        self.masks = {t: encoder_mask(c, t == "sliding_attention", 0, P, 0, device) for t in set(c.layer_types)}

    @torch.no_grad()
    def run(self, i: int, enc_layer: GemmaLayer, dec_layer: GemmaLayer, acts: dict[str, torch.Tensor]
            ) -> dict[str, torch.Tensor]:
        """Layer i over the prompts (encoder, causal) and then the canvases (decoder, reading the prompts' keys
        and values as a prefix cache would hold them)."""
        t = self.config.layer_types[i]
        enc, can = acts["encoder"], acts["canvas"]
        out = {"encoder": torch.empty_like(enc), "canvas": torch.empty_like(can)}
        keep = self.config.sliding_window - 1
        for s in range(0, enc.shape[0], self.batch):
            h, k, v = enc_layer(enc[s : s + self.batch], *self.rope_enc[t], None, self.masks[t],
                                self.scalars["encoder"][i])
            if t == "sliding_attention":  # what the cache keeps for later queries
                k, v = k[:, :, max(0, k.shape[2] - keep):], v[:, :, max(0, v.shape[2] - keep):]
            g, _, _ = dec_layer(can[s : s + self.batch], *self.rope_dec[t], (k, v), None, self.scalars["decoder"][i])
            out["encoder"][s : s + self.batch], out["canvas"][s : s + self.batch] = h, g
        return out


def _layer_stats(layer: GemmaLayer, options: QuantizeOptions, device: torch.device) -> LayerStats:
    """pipeline.LayerStats over the layer's linears, and the experts' statistics from their forward's input
    (the normed tokens, their expert ids) with Gemma's activation."""
    stats = LayerStats(layer, options, device, targets=layer_targets(layer))
    act = ACTIVATIONS[layer.experts.config.hidden_activation]

    def hook(module, args) -> None:
        stats.add_experts(args[0], args[2], module.gate_up_proj, act)

    stats.handles.append(layer.experts.register_forward_pre_hook(hook))
    return stats


def _materialize(model: DiffusionGemma, plan: dict, prefix: str, device: torch.device) -> None:
    """Allocate the module at `prefix` (our name) on the device and read its tensors."""
    model.get_submodule(prefix).to_empty(device=device)
    copy_weights(model, plan, only=lambda n: n.startswith(prefix + "."))  # scanned for NaN/Inf up front


def _first_activations(model: DiffusionGemma, plan: dict, src: Path, options: QuantizeOptions,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """Embedded prompts (the encoder's input) and canvases (the decoder's, self-conditioned as the module
    docstring says), in fp32; the embeddings are freed again."""
    c = model.config
    prompts, clean, noisy, conditioned = calibration_canvases(src, c, options)
    parts = ["decoder.embed_tokens", "self_conditioning"] + (["encoder.embed_tokens"] if model.encoder else [])
    for part in parts:
        _materialize(model, plan, part, device)
    with torch.no_grad():
        enc = model.encoder_stack().embed(prompts.to(device), c.embed_scale).float()
        embeds = model.decoder.embed(noisy.to(device), c.embed_scale)
        # The previous step's prediction, taken as the clean text: its one-hot soft embedding (zero: no signal).
        soft = model.decoder.embed(clean.to(device), c.embed_scale) * conditioned.to(device)[:, None, None]
        can = model.self_conditioning(embeds, soft).float()
    for part in parts:
        model.get_submodule(part).to(device="meta")
    return {"encoder": enc, "canvas": can}


def _quantize_into(src: Path, out: Path, options: QuantizeOptions, t0: float, config: DiffusionGemmaConfig,
                   model: DiffusionGemma, headers: dict, plan: dict, partial: Path, state: dict | None,
                   on_layer) -> QuantizeReport:
    device = torch.device(options.device)
    n_layers = config.num_hidden_layers
    n_shards = n_layers + 1
    src_dtype = SAFETENSORS_TO_TORCH.get(headers["model.decoder.embed_tokens.weight"].dtype, torch.bfloat16)
    src_names = tensor_names(model)  # before any module is swapped: the source's names and ours
    state_file, acts_file = partial / STATE_FILE, partial / ACTS_FILE
    P, C = canvas_split(config, options.seqlen)
    for which in ("encoder", "decoder"):  # the per-layer scalars, read once
        setattr(model, f"{which}_layer_scalar", torch.empty(n_layers, device=device))
    copy_weights(model, plan, only=lambda n: n.endswith("_layer_scalar"))
    scalars = {w: getattr(model, f"{w}_layer_scalar").float() for w in ("encoder", "decoder")}
    if state is None:
        acts = _first_activations(model, plan, src, options, device)
        state = _new_state(src, options)
    else:
        acts = torch.load(acts_file, map_location=device)
    walk = _Walk(model, P, C, scalars, device, options.batch_size)
    fallbacks = [f for entry in state["layers"] for f in entry["fallback_experts"]]
    for i in range(state["next_layer"], n_layers):
        lt = time.perf_counter()
        names = [(f"{ours}.{i}", f"{hub}.{i}.") for ours, hub in stacks(model)]
        for ours, _ in names:
            _materialize(model, plan, ours, device)
        layers = [model.get_submodule(ours) for ours, _ in names]
        enc_layer, dec_layer = layers[0], layers[-1]  # the same module when tied
        stats = [_layer_stats(layer, options, device) for layer in layers]
        walk.run(i, enc_layer, dec_layer, acts)  # collects the Hessians
        summary: dict[str, list[float]] = {}
        layer_fallbacks, tokens = [], []
        for layer, st, (_, hub) in zip(layers, stats, names, strict=True):
            st.close()
            for kind, errs in quantize_linears(layer, layer_targets(layer), st, options, device).items():
                summary.setdefault(kind, []).extend(errs)
            layer.experts, fb = quantize_experts(layer.experts, st, options, device, f"{hub}experts", summary,
                                                 activation=config.hidden_activation)
            layer_fallbacks += fb
            tokens.append(st.groups["attn_in"].n)
        del stats
        acts = walk.run(i, enc_layer, dec_layer, acts)
        for key, value in acts.items():
            _check_finite(value, f"the {key} output of layer {i} on the calibration data")
        tensors = {}
        for layer, (_, hub) in zip(layers, names, strict=True):
            tensors.update(checkpoint_tensors(layer, dtype=src_dtype, prefix=hub))
        for ours, _ in names:  # free it
            stack, _, index = ours.rpartition(".")
            model.get_submodule(stack)[int(index)] = torch.nn.Identity()
        entry = {"layer": i, "kind": config.layer_types[i].replace("_attention", ""),
                 "errors": {k: sum(v) / len(v) for k, v in summary.items() if v},
                 "fallback_experts": layer_fallbacks, "hessian_tokens": tokens}
        save_layer(partial, i, n_shards, tensors, acts, acts_file, state, state_file, entry)
        fallbacks += layer_fallbacks
        if on_layer:
            on_layer(i, n_layers, {**entry, "seconds": time.perf_counter() - lt})
        del layers, enc_layer, dec_layer, tensors  # one layer on the device at a time

    # The last shard: what no layer shard holds (embeddings, norms, layer scalars, self-conditioning, vision).
    layer_weights = {n for n, (ours, _) in src_names.items() if ours.startswith(("decoder.layers.", "encoder.layers."))}
    last = {}
    for name, info in headers.items():
        if name in layer_weights or _skip_reason(name, config) == "tied copy":
            continue
        with safe_open(str(info.file), framework="pt", device="cpu") as f:
            last[name] = f.get_tensor(name)
    extra = {"calibration_windows": {"prompt": P, "canvas": C, "self_conditioning": options.calibration == "diffusion"},
             "tied_encoder_decoder": model.encoder is None}
    return finish_run(partial, out, src, None, options, state, fallbacks, None, n_shards, last, None,
                      sum(f.stat().st_size for f in {i.file for i in headers.values()}), t0, extra)
