"""Fused element-wise kernels of the decoder layer: RMSNorm (with
the residual add before it), rotary embedding of q and k in place (and, in the
same launch, k and v stored into the paged KV cache), SiLU-gated product. One
Triton launch each instead of four to ten torch kernels.

Owns the Triton kernels and their torch references; the model picks one set
per device (``ops_for``): Triton on CUDA, the references elsewhere.

Semantics are those of the torch references below, op by op and rounding by
rounding in the activations' dtype: ``rope_qk_kv_`` and ``silu_mul`` round every
intermediate exactly where torch's bf16/fp16 arithmetic does, so they agree
bit for bit; ``add_rms_norm`` reduces the row's sum of squares in another
order than torch, so its output may differ in the last bit of some elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlora.kernels import silu_mul_ref  # silu(gate) * up of [gate | up]; also the fused LoRA path's
from mlora.kernels.triton_act import _silu_product  # the one rounding of silu(g) * u

# ------------------------------------------------------------------ references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), statistics in float32, result in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta)): the residual add, then the next norm."""
    h = h + delta
    return h, rms_norm_ref(h, weight, eps)


def rope_qk_ref_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
                 head_dim: int) -> torch.Tensor:
    """Rotate-half RoPE of the q and k columns of ``qkv`` [T, (q_heads + 2 kv_heads) * head_dim],
    in place; cos, sin [T, head_dim]. v is untouched. Returns qkv."""
    T = qkv.shape[0]
    n = (q_heads + kv_heads) * head_dim
    x = qkv[:, :n].reshape(T, q_heads + kv_heads, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    qkv[:, :n] = (x * cos[:, None, :] + rotated * sin[:, None, :]).reshape(T, n)
    return qkv


def rope_qk_kv_ref_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
                    head_dim: int, kv, layer: int, slot_mapping: torch.Tensor) -> torch.Tensor:
    """:func:`rope_qk_ref_`, then the layer's rotated k and its v written into the paged KV
    cache ``kv`` (a :class:`~mlora.batch.model.kvcache.KVCache`) at ``slot_mapping``. Returns qkv."""
    rope_qk_ref_(qkv, cos, sin, q_heads, kv_heads, head_dim)
    _write_kv(qkv, q_heads, kv_heads, head_dim, kv, layer, slot_mapping)
    return qkv


def _write_kv(qkv, q_heads, kv_heads, head_dim, kv, layer, slot_mapping) -> None:
    """``KVCache.write`` of the k and v columns of ``qkv`` (after RoPE)."""
    T, n_q, n_kv = qkv.shape[0], q_heads * head_dim, kv_heads * head_dim
    k = qkv[:, n_q : n_q + n_kv].reshape(T, kv_heads, head_dim)
    v = qkv[:, n_q + n_kv : n_q + 2 * n_kv].reshape(T, kv_heads, head_dim)
    kv.write(layer, k, v, slot_mapping)


# ------------------------------------------------------------------ Triton


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, hout_ptr, x_ptr, n, eps, stride_h, stride_d, stride_ho, stride_x,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
    if HAS_DELTA:  # h + delta, rounded to the activations' dtype as torch's add is
        d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(hout_ptr + row * stride_ho + cols, h, mask=ok)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n + eps)
    normed = (hf * inv).to(h_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * stride_x + cols, out, mask=ok)


@triton.jit
def _rope_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_t, stride_c, stride_s, heads, half,
                    k_ptr, v_ptr, slot_ptr, q_heads, kv_heads, block_size,
                    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                    HALF_P2: tl.constexpr, HEADS_P2: tl.constexpr, WRITE_KV: tl.constexpr = False,
                    KV_P2: tl.constexpr = 1):
    """Rotate q and k of one row in place; with ``WRITE_KV`` also store the rotated k heads
    and the row's v heads at its cache slot (block ``slot // block_size``, offset ``slot %
    block_size``; cache strides per block, offset and head, head_dim contiguous)."""
    row = tl.program_id(0).to(tl.int64)
    hd = tl.arange(0, HEADS_P2)[:, None]
    i = tl.arange(0, HALF_P2)[None, :]
    ok = (hd < heads) & (i < half)
    base = qkv_ptr + row * stride_t + hd * (2 * half) + i
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + half, mask=ok, other=0.0)
    c = tl.load(cos_ptr + row * stride_c + i, mask=i < half, other=0.0).to(tl.float32)  # cos[t, i] == cos[t, i + half]
    s = tl.load(sin_ptr + row * stride_s + i, mask=i < half, other=0.0).to(tl.float32)
    dt = qkv_ptr.dtype.element_ty
    # torch: x * cos + cat(-x2, x1) * sin, every product and the sum rounded to dt
    a1 = (x1.to(tl.float32) * c).to(dt).to(tl.float32)
    b1 = (-(x2.to(tl.float32)) * s).to(dt).to(tl.float32)  # negation is exact in either dtype
    a2 = (x2.to(tl.float32) * c).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s).to(dt).to(tl.float32)
    r1 = (a1 + b1).to(dt)
    r2 = (a2 + b2).to(dt)
    tl.store(base, r1, mask=ok)
    tl.store(base + half, r2, mask=ok)
    if WRITE_KV:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        blk = slot // block_size
        off = slot % block_size
        kmask = ok & (hd >= q_heads)  # heads q_heads .. heads-1 are k's
        kdst = k_ptr + blk * stride_kb + off * stride_ko + (hd - q_heads) * stride_kh + i
        tl.store(kdst, r1, mask=kmask)
        tl.store(kdst + half, r2, mask=kmask)
        vh = tl.arange(0, KV_P2)[:, None]
        d = tl.arange(0, 2 * HALF_P2)[None, :]
        vmask = (vh < kv_heads) & (d < 2 * half)
        vv = tl.load(qkv_ptr + row * stride_t + (heads + vh) * (2 * half) + d, mask=vmask, other=0.0)
        tl.store(v_ptr + blk * stride_vb + off * stride_vo + vh * stride_vh + d, vv, mask=vmask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * stride_g + inter + cols, mask=ok, other=0.0)
    # torch's silu rounded to the output dtype, then the product (shared with the fused LoRA kernel)
    tl.store(out_ptr + row * stride_o + cols, _silu_product(g, u, out_ptr.dtype.element_ty), mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def add_rms_norm_triton(h, delta, weight, eps):
    """(h + delta, rms_norm(h + delta)) in one pass; ``delta`` None: (h, rms_norm(h))."""
    n = h.shape[-1]
    h2 = h.reshape(-1, n)
    x = torch.empty_like(h2)
    if delta is None:
        hout, d2 = h2, h2
    else:
        d2 = delta.reshape(-1, n)
        hout = torch.empty_like(h2)
    if h2.shape[0]:
        block = _pow2(n)
        _add_rms_norm_kernel[(h2.shape[0],)](
            h2, d2, weight, hout, x, n, eps, h2.stride(0), d2.stride(0), hout.stride(0), x.stride(0),
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return hout.view(h.shape), x.view(h.shape)


def rope_qk_triton_(qkv, cos, sin, q_heads, kv_heads, head_dim):
    if qkv.shape[0]:
        heads = q_heads + kv_heads
        _rope_qk_kernel[(qkv.shape[0],)](qkv, cos, sin, qkv.stride(0), cos.stride(0), sin.stride(0), heads,
                                         head_dim // 2, qkv, qkv, qkv, 0, 0, 1, 0, 0, 0, 0, 0, 0,
                                         HALF_P2=_pow2(head_dim // 2), HEADS_P2=_pow2(heads), num_warps=4)
    return qkv


def rope_qk_kv_triton_(qkv, cos, sin, q_heads, kv_heads, head_dim, kv, layer, slot_mapping):
    """:func:`rope_qk_kv_ref_` in one launch (the RoPE kernel also stores k and v at their
    slots: no separate cache-write kernels); where the cache's dtype differs from qkv's, its
    head_dim is not contiguous or head_dim is odd, the RoPE kernel alone and then ``KVCache.write``."""
    kc, vc = kv.k[layer], kv.v[layer]
    if kc.dtype != qkv.dtype or kc.stride(3) != 1 or vc.stride(3) != 1 or head_dim % 2:
        rope_qk_triton_(qkv, cos, sin, q_heads, kv_heads, head_dim)
        _write_kv(qkv, q_heads, kv_heads, head_dim, kv, layer, slot_mapping)
        return qkv
    if qkv.shape[0]:
        heads = q_heads + kv_heads
        _rope_qk_kernel[(qkv.shape[0],)](
            qkv, cos, sin, qkv.stride(0), cos.stride(0), sin.stride(0), heads, head_dim // 2,
            kc, vc, slot_mapping, q_heads, kv_heads, kv.block_size, kc.stride(0), kc.stride(1), kc.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2),
            HALF_P2=_pow2(head_dim // 2), HEADS_P2=_pow2(heads), WRITE_KV=True, KV_P2=_pow2(kv_heads), num_warps=4)
    return qkv


def silu_mul_triton(gate_up, inter):
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = min(_pow2(inter), 2048)
        _silu_mul_kernel[(gate_up.shape[0], -(-inter // block))](gate_up, out, inter, gate_up.stride(0),
                                                                 out.stride(0), BLOCK=block, num_warps=4)
    return out


# ------------------------------------------------------------------ dispatch


class ElementwiseOps:
    """The element-wise ops a decoder layer calls (the references, or the Triton kernels)."""

    def __init__(self, fused: bool):
        self.fused = fused
        if fused:
            self.add_rms_norm = add_rms_norm_triton
            self.rms_norm = lambda x, w, eps: add_rms_norm_triton(x, None, w, eps)[1]
            self.rope_qk_kv_ = rope_qk_kv_triton_
            self.silu_mul = silu_mul_triton
        else:
            self.add_rms_norm = add_rms_norm_ref
            self.rms_norm = rms_norm_ref
            self.rope_qk_kv_ = rope_qk_kv_ref_
            self.silu_mul = silu_mul_ref


_OPS: dict[bool, ElementwiseOps] = {}


def ops_for(device: torch.device) -> ElementwiseOps:
    """Triton kernels on CUDA, the torch references elsewhere."""
    fused = torch.device(device).type == "cuda"
    if fused not in _OPS:
        _OPS[fused] = ElementwiseOps(fused)
    return _OPS[fused]
