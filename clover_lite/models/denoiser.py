"""The block-diffusion denoiser: a config-driven transformer of GDN and attention layers with MoE or dense MLPs
(Qwen3.5-MoE hybrids, SDAR's Qwen3 / Qwen3-MoE, LLaDA2's BailingMoeV2: models/config.py says which parts).

Two ways to run it, which agree (docs/ARCHITECTURE.md section 2):
- reference: `model(input_ids, block_size=B)` -> logits of the whole sequence under the block-causal
  mask (bidirectional inside a block of the fixed grid from position 0, causal across blocks; GDN
  causal throughout), no cache;
- cached: `model.step(block, cache)` runs the positions after the committed ones against a
  DenoiseCache without changing it; `model.commit(block, cache)` appends them to the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from clover_lite.models.attention import GatedAttention
from clover_lite.models.config import ModelConfig
from clover_lite.models.gdn import GatedDeltaNet
from clover_lite.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from clover_lite.models.moe import SparseMoE
from clover_lite.runtime.cache import DenoiseCache, LayerUpdate


def block_causal_mask(
    start: int, length: int, block_size: int | None, device: torch.device
) -> torch.Tensor | None:
    """Visibility of keys [0, start+length) from queries [start, start+length): key j is visible from
    query i when block(j) <= block(i). None when every key is visible (one block, the common case;
    block_size None means the caller runs a single block)."""
    if block_size is None or length == 0:
        return None
    first_block = start // block_size
    last_block = (start + length - 1) // block_size
    if first_block == last_block:
        return None
    q_block = torch.arange(start, start + length, device=device) // block_size
    k_block = torch.arange(start + length, device=device) // block_size
    return k_block[None, :] <= q_block[:, None]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.kind = config.layer_types[index]
        if self.kind == "full_attention":
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        if config.mlp_types[index] == "moe":
            self.mlp = SparseMoE(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        offset = config.norm_unit_offset
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=offset)

    def mix(
        self, x, cos, sin, mask, past_kv, gdn_state, need_state=True, past_len=None, num_splits=None
    ) -> tuple[torch.Tensor, LayerUpdate | None]:
        """The token mixer on the normed input; returns its output and the state it would commit.
        past_len / num_splits: the static step's device-side cache length (see GatedAttention.forward)."""
        h = self.input_layernorm(x)
        if self.kind == "full_attention":
            return self.self_attn(h, cos, sin, mask, past_kv, past_len=past_len, num_splits=num_splits)
        return self.linear_attn(h, gdn_state, need_state)

    def forward(
        self, x, cos, sin, mask, past_kv, gdn_state, need_state=True, past_len=None, num_splits=None
    ) -> tuple[torch.Tensor, LayerUpdate | None]:
        mixed, update = self.mix(x, cos, sin, mask, past_kv, gdn_state, need_state, past_len, num_splits)
        h, x = self.post_attention_layernorm.forward_add(mixed, x)
        return self.mlp(h, residual=x), update  # the MoE adds x in its combine kernel


class Denoiser(nn.Module):
    backend = "torch"  # "triton" once kernels/dispatch.py installed the kernels (the engine samples with them too)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Not initialised here (the loader fills it, random models call init_random): nn.Embedding's own
        # normal_ init on the meta device imports torch._dynamo, 2-3 s of every process's first load.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        # Tied checkpoints reuse the embedding as the output projection (see `logits`).
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    # ---- pieces ---------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on the given hidden states -> fp32 logits."""
        h = self.norm(hidden)
        if self.lm_head is None:
            return torch.nn.functional.linear(h, self.embed_tokens.weight).float()
        return self.lm_head(h).float()

    def _run(
        self,
        input_ids: torch.Tensor,
        start: int,
        block_size: int | None,
        cache: DenoiseCache | None,
        skip_last_mlp: bool = False,
        need_states: bool = True,
    ) -> tuple[torch.Tensor, list[LayerUpdate | None]]:
        """Hidden states of input_ids placed at positions [start, start+L), plus every layer's update (GDN
        layers skip computing theirs when need_states is False: a denoising step discards them)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        b, L = input_ids.shape
        device = input_ids.device
        if cache is not None:
            if cache.length != start:
                raise ValueError(f"cache holds {cache.length} positions but the input starts at {start}")
            if cache.batch != b:
                raise ValueError(f"cache was built for batch {cache.batch}, input has batch {b}")
        bad = (input_ids < 0) | (input_ids >= self.config.vocab_size)
        if bool(bad.any()):
            raise ValueError(
                f"token id {int(input_ids[bad][0])} is outside the vocabulary (size {self.config.vocab_size})"
            )
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(torch.arange(start, start + L, device=device))
        mask = block_causal_mask(start, L, block_size, device)
        attn = [layer.kind == "full_attention" for layer in self.layers]
        past = [cache.kv(i) if cache is not None and a else None for i, a in enumerate(attn)]
        states = [None if a else cache.gdn_state(i) if cache is not None else self.zero_gdn_state(b, x)
                  for i, a in enumerate(attn)]
        return self.run_layers(x, cos, sin, mask, past, states, need_states, skip_last_mlp)

    def run_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past: list,
        states: list,
        need_states: bool = True,
        skip_last_mlp: bool = False,
        past_len: torch.Tensor | None = None,
        num_splits: int | None = None,
        write: Callable[[int, LayerUpdate], None] | None = None,
    ) -> tuple[torch.Tensor, list[LayerUpdate | None]]:
        """The decoder stack over hidden states x: layer i reads past[i] (its committed keys and values, for
        attention layers) or states[i] (its GDN state). skip_last_mlp: committing needs only the states, and
        the last layer's MLP feeds nothing but the logits. past_len / num_splits: the static step's
        device-side cache length (GatedAttention.forward). `write(i, update)`, if given, takes each layer's
        update as soon as it exists (the static commit writes it into the cache there: each layer reads only
        its own entries, and before the write)."""
        updates: list[LayerUpdate | None] = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            args = (x, cos, sin, mask, past[i], states[i], need_states, past_len, num_splits)
            if skip_last_mlp and i == last:
                _, update = layer.mix(*args)
            else:
                x, update = layer(*args)
            if write is not None:
                write(i, update)
            updates.append(update)
        return x, updates

    def zero_gdn_state(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        recurrent = torch.zeros(
            batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            device=like.device, dtype=torch.float32,
        )
        conv = torch.zeros(batch, c.gdn_conv_dim, c.linear_conv_kernel_dim - 1, device=like.device, dtype=like.dtype)
        return recurrent, conv

    # ---- reference path -------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, block_size: int = 1, where: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, L, vocab] (fp32) of the whole sequence under the block-causal mask, no cache.
        `where` (bool [batch, L]): the logits of those positions only, [n, vocab]; the lm_head runs on them
        alone (all of a 248K vocabulary for 8 windows of 256 positions would be 2 GB)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        hidden, _ = self._run(input_ids, 0, block_size, None)
        if where is not None:
            if where.shape != input_ids.shape or where.dtype != torch.bool:
                raise ValueError(f"where must be a bool tensor of shape {tuple(input_ids.shape)}, "
                                 f"got {where.dtype} {tuple(where.shape)}")
            hidden = hidden[where.to(hidden.device)]
        return self.logits(hidden)

    # ---- cached path ----------------------------------------------------------------------------
    def step(
        self,
        block_ids: torch.Tensor,
        cache: DenoiseCache,
        positions: torch.Tensor | None = None,
        keep_updates: bool = False,
    ) -> tuple[torch.Tensor, list[LayerUpdate] | None]:
        """One denoising step: run the block after the committed positions without changing the cache.

        `positions` (indices into the block, e.g. its masked positions) limits the logits to those rows:
        returns (logits [batch, n, vocab] fp32, the block's layer updates if keep_updates else None).
        The block must not cross a block boundary of the grid (it is one block, or its tail).
        """
        hidden, updates = self._run(block_ids, cache.length, None, cache, need_states=keep_updates)
        if positions is not None:
            hidden = hidden[:, positions]
        return self.logits(hidden), (updates if keep_updates else None)

    def commit(
        self,
        ids: torch.Tensor,
        cache: DenoiseCache,
        block_size: int,
        updates: list[LayerUpdate] | None = None,
    ) -> None:
        """Append `ids` (one or more whole blocks of the grid, or a final partial one) to the cache.

        By default a clean forward over the final tokens computes their KV and the advanced GDN state
        (exact). Passing `updates` from the last `step` reuses that step's states instead (faster,
        approximate: they were computed while the last committed positions were still masked).
        """
        if updates is None:
            _, updates = self._run(ids, cache.length, block_size, cache, skip_last_mlp=True)
        cache.apply(updates, ids.shape[1])

    def prefill(self, ids: torch.Tensor, cache: DenoiseCache, block_size: int, chunk_tokens: int = 2048) -> None:
        """Commit a prompt's whole blocks in chunks of about `chunk_tokens` (rounded to whole blocks)."""
        chunk = max(block_size, chunk_tokens // block_size * block_size)
        for s in range(0, ids.shape[1], chunk):
            self.commit(ids[:, s : s + chunk], cache, block_size)

    def new_cache(self, batch: int = 1, capacity: int = 0) -> DenoiseCache:
        p = self.embed_tokens.weight
        return DenoiseCache(self.config, batch=batch, capacity=capacity, device=p.device, dtype=p.dtype)

    def num_parameters(self) -> tuple[int, int]:
        """(total, active per token) of the model the config describes, whatever format holds its weights
        (INT4 and NF4 modules keep packed buffers, not parameters): counted on a 16-bit one built on the
        meta device. Active counts top-k routed experts instead of all of them."""
        with torch.device("meta"):
            dense = Denoiser(self.config)
        total = sum(p.numel() for p in dense.parameters())
        c = self.config
        inactive = 0
        for layer in dense.layers:
            if isinstance(layer.mlp, SparseMoE):
                per_expert = layer.mlp.experts.gate_up_proj[0].numel() + layer.mlp.experts.down_proj[0].numel()
                inactive += per_expert * (c.num_experts - c.num_experts_per_tok)
        return total, total - inactive
