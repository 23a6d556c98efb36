"""Kernel tile configurations per GPU architecture and M bucket: the one table to read and tune.

A denoising step multiplies a block of M = 16-64 rows (1-4 at the start and end of a generation) by
INT4 weights: the work is weight-bandwidth bound, so tiles are chosen to stream the weights once with
enough programs in flight (split-K when M is small), not for MMA efficiency (shared DESIGN.md section 4).
Rules the test suite checks for every entry: tile dims >= 16 (tl.dot), BLOCK_K a power of two that
divides 128 (so a tile never straddles a GPTQ group of 32/64/128), and the shared memory estimate
within the architecture's limit. On a GPU, `autotune_configs` offers the neighbours of an entry to
Triton's autotuner; under the interpreter a single config is used.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def smem_bytes(self, act_bytes: int = 2) -> int:
        """Pipelined loads per stage (activation tile [BM, BK], packed weights [BK/8, BN] int32) plus one
        dequantized operand tile [BK, BN] for tl.dot."""
        per_stage = self.block_m * self.block_k * act_bytes + self.block_k * self.block_n // 2
        return self.num_stages * per_stage + self.block_k * self.block_n * act_bytes


@dataclass(frozen=True)
class GemvConfig:
    """Few rows (M <= 4, or MoE experts holding ~1-2 rows each): no tl.dot, one row per program."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def smem_bytes(self, act_bytes: int = 2) -> int:
        return self.num_stages * (self.block_k * act_bytes + self.block_k * self.block_n // 2)


def _gemm(bm: int, bn: int, bk: int, sk: int, w: int, st: int) -> GemmConfig:
    return GemmConfig(bm, bn, bk, sk, w, st)


# (arch, M bucket) -> GEMM config. Small M: narrow N tiles and split-K so that even a 2048 x 512 expert
# projection launches a few hundred programs; large M: wider tiles, fewer splits. GeForce parts (sm_86,
# sm_89, sm_120) have ~100 KB of shared memory, hence fewer stages.
GEMM_TABLE: dict[str, dict[int, GemmConfig]] = {
    "sm_80": {1: _gemm(16, 64, 128, 4, 4, 3), 4: _gemm(16, 64, 128, 4, 4, 3), 16: _gemm(16, 64, 128, 4, 4, 3),
              32: _gemm(32, 64, 128, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 3), 1 << 30: _gemm(64, 128, 64, 1, 8, 3)},
    "sm_86": {1: _gemm(16, 64, 128, 4, 4, 2), 4: _gemm(16, 64, 128, 4, 4, 2), 16: _gemm(16, 64, 128, 4, 4, 2),
              32: _gemm(32, 64, 64, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 2), 1 << 30: _gemm(64, 128, 32, 1, 8, 2)},
    "sm_89": {1: _gemm(16, 64, 128, 4, 4, 2), 4: _gemm(16, 64, 128, 4, 4, 2), 16: _gemm(16, 64, 128, 4, 4, 2),
              32: _gemm(32, 64, 64, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 2), 1 << 30: _gemm(64, 128, 32, 1, 8, 2)},
    "sm_90": {1: _gemm(16, 128, 128, 4, 4, 4), 4: _gemm(16, 128, 128, 4, 4, 4), 16: _gemm(16, 128, 128, 4, 4, 4),
              32: _gemm(32, 128, 128, 2, 4, 3), 64: _gemm(64, 128, 64, 2, 8, 3), 1 << 30: _gemm(128, 128, 64, 1, 8, 3)},
    "sm_100": {1: _gemm(16, 128, 128, 4, 4, 4), 4: _gemm(16, 128, 128, 4, 4, 4), 16: _gemm(16, 128, 128, 4, 4, 4),
               32: _gemm(32, 128, 128, 2, 4, 3), 64: _gemm(64, 128, 64, 2, 8, 3),
               1 << 30: _gemm(128, 128, 64, 1, 8, 3)},
    "sm_120": {1: _gemm(16, 64, 128, 4, 4, 2), 4: _gemm(16, 64, 128, 4, 4, 2), 16: _gemm(16, 64, 128, 4, 4, 2),
               32: _gemm(32, 64, 64, 2, 4, 3), 64: _gemm(64, 64, 64, 2, 4, 2), 1 << 30: _gemm(64, 128, 32, 1, 8, 2)},
}
GEMV_TABLE: dict[str, GemvConfig] = {
    "sm_80": GemvConfig(64, 128, 4, 2),
    "sm_86": GemvConfig(64, 128, 4, 2),
    "sm_89": GemvConfig(64, 128, 4, 2),
    "sm_90": GemvConfig(128, 128, 4, 3),
    "sm_100": GemvConfig(128, 128, 4, 3),
    "sm_120": GemvConfig(64, 128, 4, 2),
}
# Under TRITON_INTERPRET (CPU tests) the cost grows with the number of programs: few, large tiles.
INTERPRET_GEMM = GemmConfig(16, 64, 32, 1, 4, 1)
INTERPRET_GEMV = GemvConfig(64, 32, 4, 1)
# Rows per expert below which the MoE takes the GEMV path instead of padding experts to BLOCK_M rows.
MOE_GEMV_MAX_ROWS_PER_EXPERT = 4


def arch_of(capability: tuple[int, int]) -> str:
    """(major, minor) compute capability -> the nearest table key (same major, highest minor not above)."""
    key = f"sm_{capability[0]}{capability[1]}"
    if key in GEMM_TABLE:
        return key
    same = sorted(k for k in GEMM_TABLE if k.startswith(f"sm_{capability[0]}"))
    return same[0] if same else "sm_80"


def gemm_config(arch: str, m: int) -> GemmConfig:
    table = GEMM_TABLE[arch]
    return next(table[b] for b in M_BUCKETS if m <= b)


def autotune_configs(arch: str, m: int) -> list[GemmConfig]:
    """The table's entry for (arch, M) and its neighbours that still fit: what the autotuner may try."""
    base = gemm_config(arch, m)
    out = [base]
    for bn in (64, 128):
        for sk in (1, 2, 4, 8):
            for st in (2, 3, 4):
                c = GemmConfig(base.block_m, bn, base.block_k, sk, base.num_warps, st)
                if c not in out and c.smem_bytes() <= SMEM_LIMIT[arch]:
                    out.append(c)
    return out
