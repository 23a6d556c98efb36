"""Kernel tile configurations per GPU architecture and M bucket: the one table to read and tune.

A denoising step multiplies a block of M = 16-64 rows (1-4 at the start and end of a generation) by
INT4 weights: the work is weight-bandwidth bound, so tiles are chosen to stream the weights once with
enough programs in flight (split-K when M is small), not for MMA efficiency (shared DESIGN.md section 4).
Rules the test suite checks for every entry: tile dims >= 16 (tl.dot), BLOCK_K a power of two that
divides 128 (so a tile never straddles a GPTQ group of 32/64/128), and the shared memory estimate
within the architecture's limit. The sm_90 entries are what benchmarks/sweep.py measured fastest on an
H200 (benchmarks/RESULTS.md, 2026-12-04). With CLOVER_AUTOTUNE=1, `autotune_configs` offers the neighbours of
an entry to an autotuner on the GPU; it is off by default, since it times one weight set that stays in L2
and so picked configs slower than the table's for weights read from memory (same RESULTS.md section).
Under the interpreter a single config is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

# Usable shared memory per thread block, bytes (opt-in maximum).
SMEM_LIMIT = {
    "sm_80": 163 * 1024,  # A100
    "sm_86": 99 * 1024,  # RTX 30xx
    "sm_89": 99 * 1024,  # RTX 40xx, L40
    "sm_90": 227 * 1024,  # H100 / H200
    "sm_100": 227 * 1024,  # B200 / GB300
    "sm_120": 99 * 1024,  # RTX 50xx
}
M_BUCKETS = (1, 4, 16, 32, 64, 1 << 30)  # an M goes to the first bucket >= M


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    planes: bool = True  # dot the weights as 8 nibble planes where the tile allows (no g_idx, BLOCK_K >= 128)
    # Weights in the MMA order: compute out^T = W^T x^T, the weights as the dot's first operand (see
    # mma_swap). None: mma_swap's rule; True/False: forced (the sweep, tests).
    swap: bool | None = None
    # Split K: the last split of each output tile sums the partials (int4_split_k.last_split_sums, a counter
    # per tile) instead of a second launch (int4_split_k._sum_splits) after every split GEMM.
    sum_in_kernel: bool = True

    def smem_bytes(self, act_bytes: int = 2, gathered: bool = False, fused: bool = False) -> int:
        """Pipelined loads per stage (activation tile [BM, BK], packed weights [BK/8, BN] int32) plus one
        dequantized operand tile [BK, BN] for tl.dot. `gathered`: with an act-order g_idx the scales and
        zeros are gathered per weight element and staged too, for up to two stages, for each weight set
        (two when gate and up are fused): 4 bytes per element, an upper bound on what the compiler
        allocated for sm_86 and sm_90 with run-time specialization (benchmarks/compile_check.py --as-run
        measures every configuration). It also bounds what weights in the MMA order were allocated (whose
        operand is built in registers, but whose fused gate/up and epilogue take about as much), except
        with swapped operands on sm_90, whose fused gate/up took up to 8% more (the transposed epilogue;
        far under that limit)."""
        per_stage = self.block_m * self.block_k * act_bytes + self.block_k * self.block_n // 2
        base = self.num_stages * per_stage + self.block_k * self.block_n * act_bytes
        if not gathered:
            return base
        return base + min(self.num_stages, 2) * self.block_k * self.block_n * 4 * (2 if fused else 1)


@dataclass(frozen=True)
class GemvConfig:
    """Few rows (M <= 4, or MoE experts holding ~1-2 rows each): no tl.dot, one row per program, K split up
    to split_k ways when rows x column tiles are too few programs to fill the GPU (gemv_split_to_fill)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1
    sum_in_kernel: bool = True  # as GemmConfig's (one-row tiles)

    def smem_bytes(self, act_bytes: int = 2) -> int:
        return self.num_stages * (self.block_k * act_bytes + self.block_k * self.block_n // 2)


def _gemm(bm: int, bn: int, bk: int, sk: int, w: int, st: int, planes: bool = True) -> GemmConfig:
    return GemmConfig(bm, bn, bk, sk, w, st, planes)


# (arch, M bucket) -> GEMM config. Small M: narrow N tiles and split-K so that even a 2048 x 512 expert
# projection launches a few hundred programs; large M: wider tiles, fewer splits. GeForce parts (sm_86,
# sm_89, sm_120) have ~100 KB of shared memory, hence fewer stages. BLOCK_K 128 (up to M = 32 on GeForce,
# M = 64 on sm_90/100) takes the nibble-plane path (int4_gemm._plane_tile_product): at M <= 32 on sm_86,
# BLOCK_K 64 compiled to 13.4 instructions and 1.6 int-to-float conversions per weight, more than a 3090
# issues at its bandwidth; 128 with planes, 8.7 and none; sm_90 at M <= 64: 15.3 -> 11.7. At M <= 64 planes
# cost sm_86 18% more (benchmarks/RESULTS.md, 2026-12-03).
GEMM_TABLE: dict[str, dict[int, GemmConfig]] = {
    "sm_80": {1: _gemm(16, 64, 128, 4, 4, 3), 4: _gemm(16, 64, 128, 4, 4, 3), 16: _gemm(16, 64, 128, 4, 4, 3),
              32: _gemm(32, 64, 128, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 3), 1 << 30: _gemm(64, 128, 64, 1, 8, 3)},
    "sm_86": {1: _gemm(16, 64, 128, 4, 4, 2), 4: _gemm(16, 64, 128, 4, 4, 2), 16: _gemm(16, 64, 128, 4, 4, 2),
              32: _gemm(32, 64, 128, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 2), 1 << 30: _gemm(64, 128, 32, 1, 8, 2)},
    "sm_89": {1: _gemm(16, 64, 128, 4, 4, 2), 4: _gemm(16, 64, 128, 4, 4, 2), 16: _gemm(16, 64, 128, 4, 4, 2),
              32: _gemm(32, 64, 128, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 2), 1 << 30: _gemm(64, 128, 32, 1, 8, 2)},
    # sm_90, measured on an H200 (benchmarks/sweep.py, 2026-12-04; time of one Clover step's dense INT4 calls):
    # M <= 16 3.31 -> 3.12 ms, M <= 32 5.54 -> 3.78 ms (split up to 4, not 2), M <= 64 8.84 -> 3.49 ms (the
    # unpacked tile, 64 columns, 4 warps: planes at 64 rows ran 2-2.5x slower). 64-column tiles won by < 1%
    # at M <= 16/32 but ran the lm_head 1.4x slower. sm_100 copies sm_90 (unmeasured).
    "sm_90": {1: _gemm(16, 128, 128, 4, 4, 3), 4: _gemm(16, 128, 128, 4, 4, 3), 16: _gemm(16, 128, 128, 4, 4, 3),
              32: _gemm(32, 128, 128, 4, 4, 3), 64: _gemm(64, 64, 128, 4, 4, 3, planes=False),
              1 << 30: _gemm(128, 128, 64, 1, 8, 3)},
    "sm_100": {1: _gemm(16, 128, 128, 4, 4, 3), 4: _gemm(16, 128, 128, 4, 4, 3), 16: _gemm(16, 128, 128, 4, 4, 3),
               32: _gemm(32, 128, 128, 4, 4, 3), 64: _gemm(64, 64, 128, 4, 4, 3, planes=False),
               1 << 30: _gemm(128, 128, 64, 1, 8, 3)},
    "sm_120": {1: _gemm(16, 64, 128, 4, 4, 2), 4: _gemm(16, 64, 128, 4, 4, 2), 16: _gemm(16, 64, 128, 4, 4, 2),
               32: _gemm(32, 64, 128, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 2), 1 << 30: _gemm(64, 128, 32, 1, 8, 2)},
}
GEMV_TABLE: dict[str, GemvConfig] = {
    "sm_80": GemvConfig(64, 128, 4, 2, split_k=16),
    "sm_86": GemvConfig(64, 128, 4, 2, split_k=16),
    "sm_89": GemvConfig(64, 128, 4, 2, split_k=16),
    "sm_90": GemvConfig(128, 128, 4, 3, split_k=16),
    "sm_100": GemvConfig(128, 128, 4, 3, split_k=16),
    "sm_120": GemvConfig(64, 128, 4, 2, split_k=16),
}
# The MoE's GEMV (one program per (token, expert) pair and column tile), where it differs from GEMV_TABLE:
# on an H200 at a 32-token block (163 experts touched) every tile, K step and stage count tried ran within 3%
# of each other at 2 warps, and 2 warps ran 10% faster than 4 (fused MoE 227 us against 251 us,
# benchmarks/sweep.py, 2026-12-04).
MOE_GEMV_TABLE: dict[str, GemvConfig] = {
    "sm_90": GemvConfig(64, 128, 2, 4, split_k=16),
}
# GEMV programs in flight per SM that the split aims at. Its loads are plain (not cp.async pipelined): a
# program has one [BK/8, BN] tile of words in flight (8 KB at 128 x 128), and an H200 needs about 25 KB in
# flight per SM to cover its memory latency at full bandwidth (4.8 TB/s x ~0.7 us / 132 SMs).
GEMV_PROGRAMS_PER_SM = 4
# Under TRITON_INTERPRET (CPU tests) the cost grows with the number of programs: few, large tiles.
INTERPRET_GEMM = GemmConfig(16, 64, 32, 1, 4, 1)
INTERPRET_GEMV = GemvConfig(128, 64, 4, 1)
INTERPRET_MOE_GEMV = INTERPRET_GEMV  # the MoE's GEMV there (tests set a split)
# Rows per expert below which the MoE takes the GEMV path instead of padding experts to BLOCK_M rows.
MOE_GEMV_MAX_ROWS_PER_EXPERT = 4


def arch_of(capability: tuple[int, int]) -> str:
    """(major, minor) compute capability -> the nearest table key (same major, highest minor not above)."""
    key = f"sm_{capability[0]}{capability[1]}"
    if key in GEMM_TABLE:
        return key
    same = sorted(k for k in GEMM_TABLE if k.startswith(f"sm_{capability[0]}"))
    return same[0] if same else "sm_80"


def gemv_config(arch: str, moe: bool = False) -> GemvConfig:
    return MOE_GEMV_TABLE.get(arch, GEMV_TABLE[arch]) if moe else GEMV_TABLE[arch]


def gemm_config(arch: str, m: int) -> GemmConfig:
    table = GEMM_TABLE[arch]
    return next(table[b] for b in M_BUCKETS if m <= b)


def for_mma_order(cfg: GemmConfig, arch: str) -> GemmConfig:
    """The config for weights in the MMA order (kernels/mma_layout.py): K tiles of whole 128-row blocks, whose
    words are contiguous and load 16 bytes at a time. Compiled for sm_86 and sm_90 (Triton 3.6 and 3.9) that
    was fewer instructions per weight than 32- or 64-row tiles at every M bucket. Stages are dropped while the
    wider tiles would not fit the shared memory (the tables' entries all fit: the test suite checks)."""
    cfg = replace(cfg, block_k=128)
    while cfg.num_stages > 1 and cfg.smem_bytes(fused=True) > SMEM_LIMIT[arch]:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


# Swapped operands for weights in the MMA order, by architecture, where a Triton lays 16-bit dot operands out
# with kWidth 4 (order 4: Triton < 3.9) at every M bucket. The rule below came from compiled code
# (benchmarks/compile_check.py --as-run, cases "mma" and "mma swap"; K-loop instructions per thread, both
# Tritons, RESULTS.md "Swapped operands"): with x as the first operand, kWidth 4 has the compiler copy x's
# registers into each MMA's operand quad (sm_90, Triton 3.6, M <= 32: 254 moves a K step); as the second
# operand x loads straight into place. The consumer parts gain only from M > 32.
MMA_SWAP_EVERY_M = {4: ("sm_90", "sm_100")}


def mma_swap(cfg: GemmConfig, arch: str | None, order: int, fp32: bool = False) -> bool:
    """Whether a GEMM on weights in the MMA order `order` runs with swapped operands (int4_gemm._mma_tile_product:
    W^T x^T, the weights as the first operand): the config's choice if it makes one; else on a GPU, for
    tiles of more than 32 rows, at every M on the architectures of MMA_SWAP_EVERY_M for this order, and
    always for fp32 activations (IEEE dots without tensor cores: as is, sm_86 and sm_90 spilled 3-9 KB a
    thread and ran twice the instructions); never under the interpreter (arch None) unless the config asks."""
    if cfg.swap is not None:
        return cfg.swap
    if arch is None or not order:
        return False
    return fp32 or cfg.block_m > 32 or arch in MMA_SWAP_EVERY_M.get(order, ())


def for_gathered_groups(cfg: GemmConfig, arch: str, fused: bool) -> GemmConfig:
    """The config for weights with an act-order g_idx: BLOCK_K halved (not below 16, tl.dot's minimum)
    until the per-element scales and zeros fit the architecture's shared memory."""
    while cfg.block_k > 16 and cfg.smem_bytes(gathered=True, fused=fused) > SMEM_LIMIT[arch]:
        cfg = replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def split_to_fill(cfg: GemmConfig, tiles: int, sms: int) -> GemmConfig:
    """Split K only as far as filling the GPU needs (two programs per SM, or the table's split). Each split
    writes an fp32 partial [M, N] that is read back and summed: 2 * split * M * N * 4 bytes against
    K * N / 2 of weights, half again the weight traffic at M = 16, K = 2048, split 4. A wide N (the
    lm_head's 1,940 tiles of 128) fills the GPU with no split at all."""
    split = 1
    while split < cfg.split_k and tiles * split < 2 * sms:
        split *= 2
    return replace(cfg, split_k=min(split, cfg.split_k))


def gemv_split_to_fill(cfg: GemvConfig, programs: int, k: int, sms: int) -> GemvConfig:
    """Split K (powers of two up to the table's split_k, each split at least one BLOCK_K tile) while the
    launch stays within GEMV_PROGRAMS_PER_SM programs per SM. An M = 1 projection 2048 -> 8192 is 64 column
    tiles of 128: unsplit it would leave half an H200's SMs idle and the rest with one tile in flight; split
    8 it runs 512 programs. Partial sums cost 2 * split * rows * N * 4 bytes against K * N / 2 of weights
    (6% there)."""
    split = 1
    while (split < cfg.split_k and 2 * programs * split <= GEMV_PROGRAMS_PER_SM * sms
           and k >= 2 * split * cfg.block_k):
        split *= 2
    return replace(cfg, split_k=split)


def autotune_configs(arch: str, m: int, base: GemmConfig | None = None) -> list[GemmConfig]:
    """The table's entry for (arch, M), or `base`, and its neighbours that still fit: what the autotuner
    may try (the first is kept if every one fails)."""
    base = base or gemm_config(arch, m)
    out = [base]
    for bn in (64, 128):
        for sk in (1, 2, 4, 8):
            for st in (2, 3, 4):
                c = GemmConfig(base.block_m, bn, base.block_k, sk, base.num_warps, st, base.planes)
                if c not in out and c.smem_bytes() <= SMEM_LIMIT[arch]:
                    out.append(c)
    return out


# ---- Gated DeltaNet block kernel (kernels/gdn.py) ---------------------------------------------------
# Tokens per chunk, value columns per program, warps, and the precision of its tl.dot products. Compiled
# as launched for sm_90 (benchmarks/compile_check.py --as-run, which reads registers and stack from the
# cubin): fp32 "ieee" dots (FMA loops, no tensor cores) at 64 x 64 held 32 registers and spilled an
# 18.6 KB stack per thread; tf32 tensor-core dots at 16 x 32 use 243 registers and no stack. tf32 rounds
# the dot operands to 10-bit mantissas: ~5e-4 relative error over 8K tokens, no growth (a test emulates
# it), an order below the bf16 activations around the kernel. Clover: 32 value heads x 128/32 = 128
# programs per sequence, about one per SM.
GDN_BLOCK_T = 16
GDN_BLOCK_V = 32
GDN_NUM_WARPS = 4
GDN_DOT_PRECISION = "tf32"


# ---- block attention (kernels/attention.py) -----------------------------------------------------------
# A denoising step's attention is decode-like (shared DESIGN.md section 7): the rows of a program are the
# Hq/Hkv query heads of one kv head times the block's L positions (GQA packing, 8 x 32 = 256 rows for
# Clover), the KV length is split across programs (flash-decoding) and the splits are merged exactly.
# Rules the test suite checks for every entry: block_m, block_n >= 16 (every tl.dot dim; head_dim is a
# multiple of 16), powers of two, and the shared memory estimate within SMEM_LIMIT for head_dim 128 and 256.


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # packed rows (q heads x block positions) per program; fewer rows get a smaller power of two
    block_n: int  # keys per inner step
    num_warps: int = 4
    num_stages: int = 2
    merge_rows: int = 16  # rows per program of the split-merge kernel

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Q tile [BM, D] once, K and V tiles [BN, D] per pipeline stage, and the probabilities [BM, BN]
        re-laid out as the second dot's operand. Conservative: Triton may keep Q and P in registers."""
        q = self.block_m * head_dim
        kv = self.num_stages * 2 * self.block_n * head_dim
        p = self.block_m * self.block_n
        return (q + kv + p) * elem_bytes


ATTENTION_HEAD_DIMS = (128, 256)  # table columns: head_dim <= 128 uses the 128 entry, up to 256 the 256 one
# (arch, head_dim) -> config, for fp16/bf16 inputs. head_dim 256 keeps 64 rows per program (a [64, 256] fp32
# accumulator is 64 registers per thread at 8 warps); GeForce parts (~100 KB of shared memory) run fewer stages
# or keys. Compiled offline (triton 3.9, no GPU) every entry's shared memory came out below its estimate; ptxas
# reported no spills except the num_splits == 1 epilogue with the gate (255 registers, <= 60 bytes spilled).
ATTENTION_TABLE: dict[str, dict[int, AttentionConfig]] = {
    "sm_80": {128: AttentionConfig(128, 64, 8, 2), 256: AttentionConfig(64, 32, 8, 3)},
    "sm_86": {128: AttentionConfig(64, 64, 8, 2), 256: AttentionConfig(64, 32, 8, 1)},
    "sm_89": {128: AttentionConfig(64, 64, 8, 2), 256: AttentionConfig(64, 32, 8, 1)},
    "sm_90": {128: AttentionConfig(128, 64, 8, 3), 256: AttentionConfig(64, 64, 8, 2)},
    "sm_100": {128: AttentionConfig(128, 64, 8, 3), 256: AttentionConfig(64, 64, 8, 2)},
    "sm_120": {128: AttentionConfig(64, 64, 8, 2), 256: AttentionConfig(64, 32, 8, 1)},
}
# Under TRITON_INTERPRET: one program holds every packed row (up to 8 heads x 64 positions) and takes
# 256 keys per step, so a test launches few programs with few iterations.
INTERPRET_ATTENTION = AttentionConfig(512, 256, 4, 1, 256)
# Automatic split count: at least this many cache keys per split, and enough splits for about
# ATTENTION_WAVES programs per SM, never more than ATTENTION_MAX_SPLITS.
ATTENTION_MIN_KEYS_PER_SPLIT = 512
ATTENTION_WAVES = 2
ATTENTION_MAX_SPLITS = 128
ATTENTION_MAX_BLOCK_LEN = 64  # query positions of one block the attention kernel takes (its row tiles)


def attention_config(arch: str, head_dim: int, elem_bytes: int = 2) -> AttentionConfig:
    """The table entry for (arch, head_dim), shrunk (fewer stages, then fewer keys, then fewer rows) until it
    fits the architecture's shared memory for this element size. fp32 inputs (a correctness path on a GPU:
    tl.dot in IEEE fp32 runs without tensor cores) start from 16 rows x 32 keys, 4 warps, one stage."""
    col = next((d for d in ATTENTION_HEAD_DIMS if head_dim <= d), ATTENTION_HEAD_DIMS[-1])
    c = ATTENTION_TABLE[arch][col]
    if elem_bytes >= 4:
        c = AttentionConfig(16, min(c.block_n, 32), 4, 1, c.merge_rows)
    limit = SMEM_LIMIT[arch]
    while c.smem_bytes(col, elem_bytes) > limit:
        if c.num_stages > 1:
            c = AttentionConfig(c.block_m, c.block_n, c.num_warps, c.num_stages - 1, c.merge_rows)
        elif c.block_n > 16:
            c = AttentionConfig(c.block_m, c.block_n // 2, c.num_warps, c.num_stages, c.merge_rows)
        elif c.block_m > 16:
            c = AttentionConfig(c.block_m // 2, c.block_n, c.num_warps, c.num_stages, c.merge_rows)
        else:
            break
    return c


# ---- what a GPU has verified -------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelChanges:
    """Kernel changes made since the last GPU session, each on or off."""

    mma_order: bool  # INT4 words rearranged at load into the tensor cores' operand order (mma_layout.py);
    # swapped operands (mma_swap) apply only to weights in that order, so this switches them too
    sum_in_kernel: bool  # the last K split of each tile sums the partials in the same launch
    # (int4_split_k.last_split_sums)
    diffusion_gemma: bool = False  # DiffusionGemma's INT4 linears, GELU experts (gate and up unfused) and norms
    # on the Triton kernels under `auto` (kernels/forwards.py); off: its reference path on a GPU too


@dataclass(frozen=True)
class Verified:
    """The configuration a GPU session last ran and checked: what every GPU user gets by default."""

    date: str
    card: str
    commit: str
    changes: KernelChanges


# Promote a change by setting it True here, with the RESULTS.md line of the GPU session that verified it.
VERIFIED = Verified(date="2026-12-04", card="H200", commit="fe1975c",
                    changes=KernelChanges(mma_order=False, sum_in_kernel=False))
# Never run on a GPU: MMA-order weights and swapped operands, the in-kernel split-K sum, DiffusionGemma on the
# kernels (benchmarks/RESULTS.md).
UNVERIFIED = KernelChanges(mma_order=True, sum_in_kernel=True, diffusion_gemma=True)
UNVERIFIED_SWITCH = "CLOVER_KERNELS_UNVERIFIED"


def kernel_changes() -> KernelChanges:
    """The changes in force: the verified configuration, or with CLOVER_KERNELS_UNVERIFIED=1 every change not
    yet verified on a GPU. Read when a model's kernels are installed (kernels/forwards.py), once per load."""
    value = os.environ.get(UNVERIFIED_SWITCH, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{UNVERIFIED_SWITCH} must be 0 or 1, got '{value}'")
    return UNVERIFIED if value == "1" else VERIFIED.changes
