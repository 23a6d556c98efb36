"""DenoiseCache: the committed past of one sequence, the only state a denoising step reads.

It holds the keys/values of every committed position for the full-attention layers and, for each
Gated DeltaNet layer, the fp32 recurrent state and the conv tail after the last committed token.
A denoising step reads it and never writes it; `apply` (called by `Denoiser.commit`) appends a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clover_lite.models.config import ModelConfig


@dataclass
class AttentionUpdate:
    """Keys and values of the positions being committed: [batch, kv_heads, L, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class GDNUpdate:
    """A GDN layer's state after the positions being committed."""

    recurrent: torch.Tensor  # [batch, v_heads, k_dim, v_dim] fp32
    conv: torch.Tensor  # [batch, conv_dim, kernel - 1]


LayerUpdate = AttentionUpdate | GDNUpdate


class DenoiseCache:
    def __init__(
        self,
        config: ModelConfig,
        batch: int = 1,
        capacity: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.batch = batch
        self.device = torch.device(device)
        self.dtype = dtype
        self.length = 0
        self.capacity = capacity
        c = config
        n = c.num_hidden_layers
        self.keys: list[torch.Tensor | None] = [None] * n
        self.values: list[torch.Tensor | None] = [None] * n
        self.recurrent: list[torch.Tensor | None] = [None] * n
        self.conv: list[torch.Tensor | None] = [None] * n
        kv_shape = (batch, c.num_key_value_heads, capacity, c.head_dim)
        for i in c.attention_layers:
            self.keys[i] = torch.zeros(kv_shape, device=self.device, dtype=dtype)
            self.values[i] = torch.zeros(kv_shape, device=self.device, dtype=dtype)
        for i in c.gdn_layers:
            self.recurrent[i] = torch.zeros(
                batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                device=self.device, dtype=torch.float32,
            )
            self.conv[i] = torch.zeros(
                batch, c.gdn_conv_dim, c.linear_conv_kernel_dim - 1, device=self.device, dtype=dtype
            )

    # ---- reads -----------------------------------------------------------------------------------
    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed keys/values of an attention layer: [batch, kv_heads, length, head_dim] views."""
        return self.keys[layer][:, :, : self.length], self.values[layer][:, :, : self.length]

    def gdn_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.recurrent[layer], self.conv[layer]

    # ---- writes ----------------------------------------------------------------------------------
    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        # Grow geometrically so a caller that did not reserve still gets amortised O(1) appends.
        new_cap = max(needed, 2 * self.capacity, 64)
        for i in self.config.attention_layers:
            for store in (self.keys, self.values):
                old = store[i]
                grown = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
                grown[:, :, : self.length] = old[:, :, : self.length]
                store[i] = grown
        self.capacity = new_cap

    def reserve(self, total_length: int) -> None:
        """Pre-allocate room for `total_length` positions (the engine does this once per generation)."""
        self._reserve(total_length)

    def write(self, layer: int, update: LayerUpdate, positions: torch.Tensor) -> None:
        """One layer's update into the buffers in place: its keys and values at `positions` (a device tensor,
        so a CUDA graph can capture the write: graph.StaticStep's commit), the GDN states replaced. The
        length is the caller's to advance."""
        if isinstance(update, AttentionUpdate):
            self.keys[layer].index_copy_(2, positions, update.k.to(self.dtype))
            self.values[layer].index_copy_(2, positions, update.v.to(self.dtype))
        elif isinstance(update, GDNUpdate):
            self.recurrent[layer].copy_(update.recurrent)
            self.conv[layer].copy_(update.conv)

    def apply(self, updates: list[LayerUpdate | None], n_tokens: int) -> None:
        """Append `n_tokens` committed positions: their KV and the GDN states after them."""
        start = self.length
        self._reserve(start + n_tokens)
        positions = torch.arange(start, start + n_tokens, device=self.device)
        for i, u in enumerate(updates):
            if isinstance(u, AttentionUpdate) and u.k.shape[2] != n_tokens:
                raise ValueError(f"layer {i}: update holds {u.k.shape[2]} positions, expected {n_tokens}")
            if u is not None:
                self.write(i, u, positions)
        self.length = start + n_tokens

    def reset(self) -> None:
        """Forget every committed position (buffers are kept for reuse)."""
        self.length = 0
        for i in self.config.gdn_layers:
            self.recurrent[i].zero_()
            self.conv[i].zero_()

    def nbytes(self) -> int:
        tensors = [t for store in (self.keys, self.values, self.recurrent, self.conv) for t in store if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)
