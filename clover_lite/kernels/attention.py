"""Block attention for a denoising step: the L <= 64 positions of the current block attend to every committed
position of the cache and to every position of the block (bidirectional inside the block), flash-decoding style.

Two Triton kernels (shared DESIGN.md sections 2 and 7):
- `_block_attn_kernel`, grid (row tiles, KV splits, batch x kv heads). The rows of a program are the
  Hq/Hkv query heads of one kv head times the block's L positions, packed into one tile (GQA packing:
  row r is query head kv_head * G + r // L at position r % L), so one K/V load serves all of them. Each
  program walks its range of the cache in BLOCK_N-key steps with an online softmax (running max and sum
  in fp32, base-2 exponentials with log2(e) folded into the scale); the program of the LAST split also
  takes the block's own keys/values (k_block, v_block) as its final steps. Keys at or beyond `cache_len`
  are masked at the load, so the cache's unused capacity is never read. With one split the program
  normalises, applies sigmoid(gate) and writes the [b, L, Hq*D] output directly; with several it writes
  its unnormalised fp32 accumulator and (max, sum) stats.
- `_merge_kernel`, grid (row tiles of b*Hq*L): the exact log-sum-exp merge of the splits,
  out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s, then the gate.
`block_attention_reference` is the plain PyTorch computation the kernels are tested against.
"""

from __future__ import annotations

import math
import operator

import torch
import triton
import triton.language as tl

from clover_lite.kernels import configs
from clover_lite.kernels.host import cdiv, interpreting, next_power_of_2

_LOG2E = 1.4426950408889634
MAX_BLOCK_LEN = configs.ATTENTION_MAX_BLOCK_LEN
MAX_HEAD_DIM = 256


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, offs_n, n_ok, offs_d, d_ok, s_kn, s_kd, s_vn, s_vd, qk_scale,
            DOT_IEEE: tl.constexpr):
    """One step of the online softmax over the keys offs_n (n_ok masks the invalid ones; they are not read)."""
    kt = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                 mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # K^T [BLOCK_D, BN]
    v = tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, BLOCK_D]
    if DOT_IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _store_out(o, g_row, o_row, head, row_ok, offs_d, d_ok, D, gate_ptr, out_ptr, s_gh, s_gd, s_oc,
               HAS_GATE: tl.constexpr):
    """o [rows, BLOCK_D] fp32 (normalised) -> out[.., head * D + d] at row offsets o_row, times sigmoid(gate),
    the gate read at g_row + head * s_gh + d * s_gd (a strided view: q_proj's gate half, no copy)."""
    col = head[:, None] * D + offs_d[None, :]
    mask = row_ok[:, None] & d_ok[None, :]
    if HAS_GATE:
        g = tl.load(gate_ptr + g_row[:, None] + head[:, None] * s_gh + offs_d[None, :] * s_gd, mask=mask,
                    other=0.0).to(tl.float32)
        o = o / (1.0 + tl.exp(-g))
    tl.store(out_ptr + o_row[:, None] + col * s_oc, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _block_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, gate_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr,
    cache_len, cache_len_ptr, keys_per_split, num_splits, qk_scale, Hq, Hkv, L, D, GROUP, ROWS, n_rows,
    s_qb, s_qh, s_ql, s_qd,
    s_kcb, s_kch, s_kcn, s_kcd,
    s_vcb, s_vch, s_vcn, s_vcd,
    s_kbb, s_kbh, s_kbn, s_kbd,
    s_vbb, s_vbh, s_vbn, s_vbd,
    s_gb, s_gl, s_gh, s_gd, s_ob, s_ol, s_oc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    SPLIT: tl.constexpr, HAS_GATE: tl.constexpr, DOT_IEEE: tl.constexpr, LEN_IN_MEMORY: tl.constexpr,
):
    if LEN_IN_MEMORY:
        # The cache length is read from device memory (a CUDA graph replays with the length of the moment);
        # the splits are then sized here, each a whole number of BLOCK_N steps, trailing ones possibly empty.
        cache_len = tl.load(cache_len_ptr).to(tl.int32)
        keys_per_split = tl.cdiv(tl.cdiv(cache_len, num_splits), BLOCK_N) * BLOCK_N
    # Row tiles vary fastest, so the programs reading the same keys run next to each other (L2 reuse).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_s = tl.program_id(1)
    pid_bh = tl.program_id(2)
    # Scalar base offsets in 64 bits (a long cache can pass 2**31 elements); tile offsets stay 32-bit.
    bi = (pid_bh // Hkv).to(tl.int64)
    kvh = (pid_bh % Hkv).to(tl.int64)
    row_ok = rows < ROWS
    # GQA packing: the group's heads one after the other, L positions each
    head_in_group = rows // L
    head = (pid_bh % Hkv) * GROUP + head_in_group
    pos = rows % L
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_base = q_ptr + bi * s_qb + kvh * GROUP * s_qh
    q = tl.load(q_base + head_in_group[:, None] * s_qh + pos[:, None] * s_ql + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # A finite "minus infinity" for the running max: exp2(-1e30 - m) is 0, never NaN (inf - inf).
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)

    # This split's range of the committed cache; keys >= cache_len are never loaded.
    lo = pid_s * keys_per_split
    hi = tl.minimum(lo + keys_per_split, cache_len)
    kc_base = kc_ptr + bi * s_kcb + kvh * s_kch
    vc_base = vc_ptr + bi * s_vcb + kvh * s_vch
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, kc_base, vc_base, offs_n, offs_n < hi, offs_d, d_ok,
                                s_kcn, s_kcd, s_vcn, s_vcd, qk_scale, DOT_IEEE)
    # The block's own L keys: visible to every query, taken by the last split.
    if pid_s == num_splits - 1:
        kb_base = kb_ptr + bi * s_kbb + kvh * s_kbh
        vb_base = vb_ptr + bi * s_vbb + kvh * s_vbh
        for start in range(0, L, BLOCK_L):
            offs_l = start + tl.arange(0, BLOCK_L)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, kb_base, vb_base, offs_l, offs_l < L, offs_d, d_ok,
                                    s_kbn, s_kbd, s_vbn, s_vbd, qk_scale, DOT_IEEE)

    if SPLIT:
        # partial buffers [splits, b * Hq * L (, D)]: this program's rows start at row0
        row0 = pid_s * n_rows + bi * Hq * L
        flat = head * L + pos
        mask = row_ok[:, None] & d_ok[None, :]
        tl.store(po_ptr + row0 * D + flat[:, None] * D + offs_d[None, :], acc, mask=mask)
        tl.store(pm_ptr + row0 + flat, m_i, mask=row_ok)
        tl.store(pl_ptr + row0 + flat, l_i, mask=row_ok)
    else:
        _store_out(acc / l_i[:, None], pos * s_gl, pos * s_ol, head, row_ok, offs_d, d_ok, D,
                   gate_ptr + bi * s_gb, out_ptr + bi * s_ob, s_gh, s_gd, s_oc, HAS_GATE)


@triton.jit
def _merge_kernel(
    po_ptr, pm_ptr, pl_ptr, gate_ptr, out_ptr, n_rows, num_splits, Hq, L, D,
    s_gb, s_gl, s_gh, s_gd, s_ob, s_ol, s_oc,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m = tl.full((BLOCK_R,), -1.0e30, dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(pm_ptr + s * n_rows + r, mask=r_ok, other=-1.0e30))
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(pm_ptr + s * n_rows + r, mask=r_ok, other=-1.0e30) - m)
        l_sum += w * tl.load(pl_ptr + s * n_rows + r, mask=r_ok, other=0.0)
        part = tl.load(po_ptr + (s * n_rows + r[:, None]) * D + offs_d[None, :],
                       mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        acc += w[:, None] * part
    o = acc / tl.where(r_ok, l_sum, 1.0)[:, None]
    bi = r // (Hq * L)
    pos = r % L
    _store_out(o, bi * s_gb + pos * s_gl, bi * s_ob + pos * s_ol, (r // L) % Hq, r_ok, offs_d, d_ok, D,
               gate_ptr, out_ptr, s_gh, s_gd, s_oc, HAS_GATE)


def _gate_strides(gate: torch.Tensor, D: int) -> tuple[int, int, int, int]:
    """The gate's (batch, position, head, dim) strides, from [b, L, Hq*D] or a [b, L, Hq, D] view."""
    if gate.dim() == 4:
        return gate.stride()
    sb, sl, sc = gate.stride()
    return sb, sl, D * sc, sc


# ---- launcher ----------------------------------------------------------------------------------------
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_args(q, k_cache, v_cache, k_block, v_block, cache_len, scale, gate, num_splits):
    """Validate everything before any launch; returns (b, Hq, Hkv, L, D, capacity, cache_len)."""
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, k_block=k_block, v_block=v_block)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    for name, t in named.items():
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype} but q is {q.dtype}: all inputs must share one dtype")
    b, Hq, L, D = q.shape
    Hkv, cap = k_cache.shape[1], k_cache.shape[2]
    if not 1 <= L <= MAX_BLOCK_LEN:
        raise ValueError(f"the block length L (q.shape[2]) must be in 1..{MAX_BLOCK_LEN}, got {L}")
    if D % 16 or not 16 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 in 16..{MAX_HEAD_DIM} (64, 128, 256, ...), got {D}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"the {Hq} query heads must be a multiple of the {Hkv} kv heads")
    if tuple(k_cache.shape) != (b, Hkv, cap, D):
        raise ValueError(f"k_cache must be [b={b}, Hkv, capacity, D={D}], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, k_cache {tuple(k_cache.shape)}: must match")
    for name in ("k_block", "v_block"):
        if tuple(named[name].shape) != (b, Hkv, L, D):
            raise ValueError(f"{name} must be [b, Hkv, L, D] = {(b, Hkv, L, D)}, got {tuple(named[name].shape)}")
    if isinstance(cache_len, torch.Tensor):
        # Read on the device by the kernel: its value is the caller's promise (0..capacity), unchecked here
        # because checking would wait for the device (and cannot happen inside a CUDA graph).
        if cache_len.numel() != 1 or cache_len.dtype not in (torch.int32, torch.int64):
            raise ValueError("a tensor cache_len must hold one int32/int64 value")
        if cache_len.device != q.device:
            raise ValueError(f"cache_len is on {cache_len.device} but q is on {q.device}")
        if num_splits is None:
            raise ValueError("with a tensor cache_len, give num_splits (the grid cannot depend on the length)")
    else:
        if isinstance(cache_len, bool):
            raise ValueError("cache_len must be an int")
        try:
            cache_len = operator.index(cache_len)
        except TypeError:
            raise ValueError(f"cache_len must be an int, got {type(cache_len).__name__}") from None
        if not 0 <= cache_len <= cap:
            raise ValueError(f"cache_len must be in 0..capacity ({cap}), got {cache_len}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if gate is not None:
        if not isinstance(gate, torch.Tensor) or tuple(gate.shape) not in ((b, L, Hq * D), (b, L, Hq, D)):
            shape = tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__
            raise ValueError(f"gate must be [b, L, Hq*D] = {(b, L, Hq * D)} or [b, L, Hq, D], got {shape}")
        if gate.dtype != q.dtype:
            raise ValueError(f"gate is {gate.dtype} but q is {q.dtype}: they must match")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    tensors = list(named.values()) + ([gate] if gate is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"inputs are on different devices: {sorted(str(d) for d in devices)}")
    return b, Hq, Hkv, L, D, cap, cache_len


def _arch(device: torch.device) -> str | None:
    if device.type != "cuda" or interpreting():
        return None
    return configs.arch_of(torch.cuda.get_device_capability(device))


def attention_config_for(device: torch.device, head_dim: int, dtype: torch.dtype) -> configs.AttentionConfig:
    arch = _arch(device)
    if arch is None:
        return configs.INTERPRET_ATTENTION
    return configs.attention_config(arch, head_dim, 4 if dtype == torch.float32 else 2)


def choose_num_splits(cache_len: int, programs_per_split: int, sm_count: int, block_n: int) -> int:
    """How many programs share the cache: 1 for short caches; for long ones enough that ~ATTENTION_WAVES
    programs per SM run, each with at least ATTENTION_MIN_KEYS_PER_SPLIT keys, at most ATTENTION_MAX_SPLITS."""
    if cache_len <= 0:
        return 1
    by_length = cdiv(cache_len, max(configs.ATTENTION_MIN_KEYS_PER_SPLIT, block_n))
    by_fill = cdiv(configs.ATTENTION_WAVES * max(1, sm_count), max(1, programs_per_split))
    return max(1, min(by_length, by_fill, configs.ATTENTION_MAX_SPLITS))


def split_plan(cache_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split): each split a whole number of BLOCK_N steps, none of them empty (a request for
    more splits than steps gets one split per step); cache_len 0 -> one split holding only the block."""
    if cache_len <= 0:
        return 1, 0
    per = cdiv(cdiv(cache_len, max(1, num_splits)), block_n) * block_n
    return cdiv(cache_len, per), per


def _row_tiles(block_m: int, rows: int) -> tuple[int, int]:
    """(block_m, number of row tiles) for `rows` = GQA group x block length query rows."""
    block_m = min(block_m, max(16, next_power_of_2(rows)))
    return block_m, cdiv(rows, block_m)


def splits_for_capacity(capacity: int, batch: int, Hq: int, Hkv: int, L: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device) -> int:
    """The num_splits to pass with a device-tensor cache_len (a CUDA graph's grid cannot follow the length):
    sized for a full cache of `capacity`; trailing splits simply stay empty while the cache is short."""
    cfg = attention_config_for(device, head_dim, dtype)
    _, m_tiles = _row_tiles(cfg.block_m, Hq // Hkv * L)
    return choose_num_splits(capacity, batch * Hkv * m_tiles, _sm_count(device), cfg.block_n)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda" or interpreting():
        return 1  # the interpreter: no parallelism to fill, fewer programs are faster
    return torch.cuda.get_device_properties(device).multi_processor_count


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # The interpreter gets bf16 arithmetic wrong (DESIGN section 5): compute in fp32 there.
    return torch.float32 if interpreting() and x.dtype == torch.bfloat16 else x.dtype


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_block: torch.Tensor,
                    v_block: torch.Tensor, cache_len: int | torch.Tensor, scale: float | None = None,
                    gate: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Attention of a denoising block over the committed cache and itself, all keys visible to all queries.

    q [b, Hq, L, D]; k_cache, v_cache [b, Hkv, capacity, D] of which the first cache_len positions are valid
    (the rest is never read); k_block, v_block [b, Hkv, L, D]; scale defaults to D**-0.5; gate [b, L, Hq*D]
    or [b, L, Hq, D] (any strides: q_proj's gate half is read in place) multiplies the output by
    sigmoid(gate). num_splits (KV splits, flash-decoding) is chosen from cache_len when None. cache_len may
    be a one-element int tensor on the device (then num_splits is required): the kernel reads it, so a
    captured CUDA graph replays with the current length. Returns [b, L, Hq*D] in q's dtype (the layout
    o_proj takes). L <= 64, Hq % Hkv == 0, D a multiple of 16 up to 256; fp16, bf16 or fp32, every input
    the same dtype, fp32 accumulation.
    """
    b, Hq, Hkv, L, D, cap, cache_len = _check_args(q, k_cache, v_cache, k_block, v_block, cache_len, scale, gate,
                                                   num_splits)
    if q.device.type != "cuda" and not interpreting():
        raise ValueError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    out_dtype = q.dtype
    cdt = _compute_dtype(q)
    in_memory = isinstance(cache_len, torch.Tensor)
    if cdt != q.dtype:  # interpreter only: fp32 copies of what the kernel reads
        q, k_block, v_block = q.to(cdt), k_block.to(cdt), v_block.to(cdt)
        n = cap if in_memory else cache_len
        k_cache, v_cache = k_cache[:, :, :n].to(cdt), v_cache[:, :, :n].to(cdt)
        gate = None if gate is None else gate.to(cdt)
    scale = D**-0.5 if scale is None else float(scale)
    cfg = attention_config_for(q.device, D, cdt)

    group = Hq // Hkv
    rows = group * L
    block_m, m_tiles = _row_tiles(cfg.block_m, rows)
    block_d = max(16, next_power_of_2(D))
    block_l = min(cfg.block_n, max(16, next_power_of_2(L)))
    if in_memory:
        splits, per_split = num_splits, 0  # sized in the kernel from the length it reads
    else:
        if num_splits is None:
            num_splits = choose_num_splits(cache_len, b * Hkv * m_tiles, _sm_count(q.device), cfg.block_n)
        splits, per_split = split_plan(cache_len, num_splits, cfg.block_n)

    out = torch.empty(b, L, Hq * D, device=q.device, dtype=cdt)
    n_rows = b * Hq * L
    if splits > 1:
        po = torch.empty(splits, n_rows, D, device=q.device, dtype=torch.float32)
        pm = torch.empty(splits, n_rows, device=q.device, dtype=torch.float32)
        pl = torch.empty(splits, n_rows, device=q.device, dtype=torch.float32)
    else:
        po = pm = pl = out  # unused
    if k_cache.shape[2] == 0:  # an empty cache may have no storage to point at; nothing is read from it
        k_cache, v_cache = k_block, v_block
    len_ptr = cache_len if in_memory else out  # unused pointer when the length is a launch argument
    g = gate if gate is not None else out
    gs = _gate_strides(gate, D) if gate is not None else (0, 0, 0, 0)
    dot_ieee = cdt == torch.float32
    _block_attn_kernel[(m_tiles, splits, b * Hkv)](
        q, k_cache, v_cache, k_block, v_block, g, out, po, pm, pl,
        0 if in_memory else cache_len, len_ptr, per_split, splits, scale * _LOG2E, Hq, Hkv, L, D, group, rows,
        n_rows,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *k_block.stride(), *v_block.stride(),
        *gs, *out.stride(),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_L=block_l,
        SPLIT=splits > 1, HAS_GATE=gate is not None, DOT_IEEE=dot_ieee, LEN_IN_MEMORY=in_memory,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        block_r = min(cfg.merge_rows, max(16, next_power_of_2(n_rows)))
        _merge_kernel[(cdiv(n_rows, block_r),)](
            po, pm, pl, g, out, n_rows, splits, Hq, L, D, *gs, *out.stride(),
            BLOCK_R=block_r, BLOCK_D=block_d, HAS_GATE=gate is not None, num_warps=4,
        )
    return out.to(out_dtype)


def block_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_block: torch.Tensor,
                              v_block: torch.Tensor, cache_len: int, scale: float | None = None,
                              gate: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Plain PyTorch: softmax(q k^T * scale) v over cat(cache[:cache_len], block) in fp32, then the gate.
    Same arguments and checks as `block_attention` (num_splits is accepted and ignored); any device."""
    b, Hq, Hkv, L, D, _, cache_len = _check_args(q, k_cache, v_cache, k_block, v_block, cache_len, scale, gate,
                                                 num_splits)
    scale = D**-0.5 if scale is None else float(scale)
    cache_len = int(cache_len)
    k = torch.cat([k_cache[:, :, :cache_len], k_block], dim=2).float().repeat_interleave(Hq // Hkv, dim=1)
    v = torch.cat([v_cache[:, :, :cache_len], v_block], dim=2).float().repeat_interleave(Hq // Hkv, dim=1)
    p = torch.softmax(q.float() @ k.transpose(-1, -2) * scale, dim=-1)
    o = (p @ v).transpose(1, 2).reshape(b, L, Hq * D)
    if gate is not None:
        o = o * torch.sigmoid(gate.float().reshape(b, L, Hq * D))
    return o.to(q.dtype)
