"""The denoising step with static shapes, captured once as a CUDA graph and replayed every step.

At batch 1 a step is hundreds of small kernel launches (~40 layers x ~10 kernels); replaying a captured
graph removes their launch cost (docs/ARCHITECTURE.md section 4). Capturing needs a forward that never waits
for the device and never changes shape: the block's token ids and the committed length live in device
buffers, attention reads the cache's whole buffers with the length read by the kernel, GDN layers read
the committed state in place, MoE layers take their no-padding GEMV path (fixed (token, expert) pairs),
and the logits of every block position are produced (the caller keeps the masked rows). A full block's
commit is captured too, as a second graph: the same forward with the GDN states computed, its keys and
values written at the device-side length (index_copy_) and the states copied into the cache; it cost an
eager forward per block, ~5 graph steps at Clover on an H200 (benchmarks/RESULTS.md). The same `forward`
runs eagerly where there is no CUDA (tests check it against the reference step and commit); it is the model's own
layer loop (Denoiser.run_layers) with the cache's whole buffers and a device-side length. Prefill and a
final partial block commit eagerly. Needs the Triton backend (the reference MoE and attention are not
capture-safe).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from clover_lite.kernels.configs import ATTENTION_MAX_BLOCK_LEN as MAX_BLOCK_LEN
from clover_lite.models.denoiser import Denoiser
from clover_lite.models.moe import SparseMoE
from clover_lite.models.quantized import QuantExperts, QuantLinear
from clover_lite.runtime.cache import DenoiseCache

# The default capacity of a static step's cache (and so of its graphs) when the engine is given none and
# free memory allows more: a longer cache costs every step's attention splits nothing, but memory.
MAX_STATIC_CONTEXT = 32768


def use_static_step(model: Denoiser, block_size: int, device: torch.device) -> bool:
    """The engine's default: a static step on CUDA wherever the model's step can be captured."""
    return device.type == "cuda" and StaticStep.supported(model, block_size) is None


class StaticStep:
    @staticmethod
    def supported(model: Denoiser, block_size: int | None = None) -> str | None:
        """None if the model's step (blocks of block_size, default the model's) can be captured, else why not."""
        if getattr(model, "backend", "torch") != "triton":
            return "the static (CUDA-graph) step needs the Triton backend"
        block = block_size or model.config.block_size or 1
        if block > MAX_BLOCK_LEN:
            return f"the static step's attention kernel takes blocks of up to {MAX_BLOCK_LEN} positions, not {block}"
        for m in model.modules():
            if isinstance(m, SparseMoE) and not (
                isinstance(m.experts, QuantExperts) and isinstance(m.experts.gate_proj, QuantLinear)
            ):
                return "only INT4 (GPTQ) experts have a capture-safe MoE kernel; 16-bit and NF4 experts run eagerly"
        return None

    def __init__(self, model: Denoiser, cache: DenoiseCache, block_size: int):
        why = self.supported(model, block_size)
        if why:
            raise ValueError(why)
        if cache.capacity < block_size:
            raise ValueError("reserve the cache's capacity before building the static step")
        self.model, self.cache, self.block_size = model, cache, block_size
        device = model.embed_tokens.weight.device
        self.ids = torch.zeros(1, block_size, dtype=torch.long, device=device)
        self.length = torch.zeros(1, dtype=torch.int32, device=device)
        self.offsets = torch.arange(block_size, device=device)
        from clover_lite.kernels.attention import splits_for_capacity  # Triton: imported only when a step is built

        c, dtype = model.config, model.embed_tokens.weight.dtype
        self.num_splits = splits_for_capacity(cache.capacity, 1, c.num_attention_heads, c.num_key_value_heads,
                                              block_size, c.head_dim, dtype, device)
        self.experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.commit_graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, commit: bool = False) -> torch.Tensor | None:
        """Logits [1, block, vocab] (fp32) of the block in self.ids after self.length committed positions; or,
        with `commit`, that block appended to the cache (its keys and values at self.length, the GDN states
        after it), as Denoiser.commit does, and None."""
        m, cache = self.model, self.cache
        # Only here (warm-up, capture, eager runs), never in prefill or an eager commit: the MoE's GEMV path
        # for every block, a fixed number of (token, expert) pairs (the padded path sizes its buffers on the
        # host).
        for e in self.experts:
            e.graph_safe = True
        try:
            x = m.embed_tokens(self.ids)
            positions = self.length.long() + self.offsets
            cos, sin = m.rotary(positions)
            attn = [layer.kind == "full_attention" for layer in m.layers]
            past = [(cache.keys[i], cache.values[i]) if a else None for i, a in enumerate(attn)]
            states = [None if a else cache.gdn_state(i) for i, a in enumerate(attn)]
            write = (lambda i, update: cache.write(i, update, positions)) if commit else None
            x, _ = m.run_layers(x, cos, sin, None, past, states, need_states=commit, skip_last_mlp=commit,
                                past_len=self.length, num_splits=self.num_splits, write=write)
            return None if commit else m.logits(x)
        finally:
            for e in self.experts:
                e.graph_safe = False

    def capture(self) -> None:
        """Warm up (kernel selection and autotuning happen outside the graphs), then capture the step and the
        commit, with the model's device current: streams and Triton's launches follow the current device,
        not the tensors. The commit's warm-ups write the cache: it is reset after them."""
        with torch.cuda.device(self.ids.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward()
                    self.forward(commit=True)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph, self.commit_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            # On our stream: torch.cuda.graph's default capture stream is made once per process, on the
            # device current then, and entering it would switch a second engine on another GPU to that one.
            with torch.cuda.graph(self.graph, stream=stream):
                self.logits = self.forward()
            with torch.cuda.graph(self.commit_graph, stream=stream):
                self.forward(commit=True)
        self.cache.reset()

    def serves(self, block_size: int, commit: str) -> bool:
        """Whether a generation with these settings runs on this step (its full blocks do): the captured commit
        is the exact one, and the graphs are of this block size."""
        return block_size == self.block_size and commit == "exact"

    def _load(self, block_ids: Sequence[int] | torch.Tensor) -> None:
        self.ids.copy_(torch.as_tensor(block_ids, dtype=torch.long).view(1, -1))  # one host-to-device copy
        self.length.fill_(self.cache.length)

    def __call__(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """block_ids (block,) or [1, block] -> logits [1, block, vocab] for the cache's current length."""
        self._load(block_ids)
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        # Eagerly (no CUDA: tests), into one buffer as a replay writes, so that a caller keeping a step's
        # logits past the next step sees them overwritten here as it would on a GPU.
        logits = self.forward()
        if self.logits is None or self.logits.shape != logits.shape:
            self.logits = torch.empty_like(logits)
        return self.logits.copy_(logits)

    def commit(self, block_ids: Sequence[int] | torch.Tensor) -> None:
        """Append one full block at the cache's length (Denoiser.commit for a block of the grid)."""
        if self.cache.length + self.block_size > self.cache.capacity:
            raise ValueError(f"the cache holds {self.cache.capacity} positions: no room for a block after "
                             f"{self.cache.length}")
        self._load(block_ids)
        if self.commit_graph is not None:
            self.commit_graph.replay()
        else:
            self.forward(commit=True)
        self.cache.length += self.block_size
