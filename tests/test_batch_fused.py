"""Fused element-wise kernels of the decoder layer against their torch references
(Triton under TRITON_INTERPRET=1 on the CPU, compiled on a GPU), fresh random
inputs, poisoned outputs."""

import pytest
import torch

from mlora.batch.model.decoder import rope_cos_sin
from mlora.kernels.elementwise import (
    add_rms_norm_ref,
    add_rms_norm_triton,
    ops_for,
    rms_norm_ref,
    rope_qk_kv_ref_,
    rope_qk_kv_triton_,
    rope_qk_ref_,
    rope_qk_triton_,
    silu_mul_ref,
    silu_mul_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same_rounding(out, ref):
    """Bit-identical on the CPU, with two exceptions. Triton's CPU interpreter
    converts float32 to bfloat16 by truncation where torch rounds to nearest even, so each
    rounding may be one bf16 ulp off: a few ulps of the tensor's scale. The compiled GPU
    kernels do not keep every intermediate rounding of torch's separate kernels (a float32
    ``a * b + c`` becomes one fused multiply-add, and the explicit round trips through 16
    bits are not kept either: some RoPE outputs differ from torch's by one ulp in every
    dtype), so on a GPU: within one ulp of the tensor's largest value."""
    if out.dtype == torch.bfloat16 and out.device.type == "cpu":
        return torch.allclose(out.float(), ref.float(), rtol=0, atol=2 ** -6 * float(ref.float().abs().max()))
    if out.device.type == "cuda":
        eps = torch.finfo(out.dtype).eps
        return torch.allclose(out.float(), ref.float(), rtol=0, atol=eps * float(ref.float().abs().max()))
    return torch.equal(out, ref)


def _rand(*shape, seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96])  # a power of two, and not one (masked tail)
def test_add_rms_norm_matches_the_reference(dtype, n):
    h, d = _rand(7, n, seed=1, dtype=dtype, scale=3), _rand(7, n, seed=2, dtype=dtype)
    w = _rand(n, seed=3, dtype=dtype) + 1
    h_ref, x_ref = add_rms_norm_ref(h, d, w, 1e-5)
    h_out, x_out = add_rms_norm_triton(h, d, w, 1e-5)
    assert same_rounding(h_out, h_ref)  # the residual add rounds exactly as torch's
    # last-bit differences of the norm (reduction order; two bf16 ulps where the interpreter truncates)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert torch.allclose(x_out.float(), x_ref.float(), rtol=tol, atol=tol)
    only_h, x2 = add_rms_norm_triton(h, None, w, 1e-5)
    assert only_h is h or torch.equal(only_h, h)
    assert torch.allclose(x2.float(), rms_norm_ref(h, w, 1e-5).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (3, 1, 24)])  # GQA; head_dim/2 not a power of two
def test_rope_in_place_matches_the_reference(dtype, heads, kv_heads, head_dim):
    T = 5
    width = (heads + 2 * kv_heads) * head_dim
    qkv = _rand(T, width, seed=4, dtype=dtype, scale=2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_cos_sin(torch.tensor([0, 3, 17, 100, 511]).to(DEVICE), inv_freq.to(DEVICE), dtype)
    ref = rope_qk_ref_(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    out = qkv.clone()
    rope_qk_triton_(out, cos, sin, heads, kv_heads, head_dim)
    assert same_rounding(out, ref)
    v0 = (heads + kv_heads) * head_dim
    assert torch.equal(out[:, v0:], qkv[:, v0:])  # v untouched
    assert not torch.equal(out[:, :v0], qkv[:, :v0])


@pytest.mark.parametrize("layout", ["layer-major", "page-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (3, 1, 24)])
def test_rope_with_the_cache_write_matches_rope_then_write(layout, dtype, heads, kv_heads, head_dim):
    """The RoPE launch that also stores k and v into the paged cache (the engine's CUDA path)
    leaves qkv exactly as the RoPE kernel alone does, and the cache exactly as KVCache.write of
    that qkv's k and v does: the written slots hold those bits, every other slot (NaN-poisoned)
    and every other layer is untouched; against the torch reference, the same rounding rule."""
    from mlora.batch.model.kvcache import KVCache

    T, layer = 6, 1
    width = (heads + 2 * kv_heads) * head_dim
    qkv = _rand(T, width, seed=9, dtype=dtype, scale=2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_cos_sin(torch.tensor([0, 3, 17, 100, 511, 7]).to(DEVICE), inv_freq.to(DEVICE), dtype)
    slots = torch.tensor([9, 0, 23, 4, 17, 12], device=DEVICE)  # 6 blocks of 4: offsets 1, 0, 3, 0, 1, 0

    def cache():
        kv = KVCache(3, 6, 4, kv_heads, head_dim, dtype, DEVICE, layout=layout)
        for t in kv.k + kv.v:
            t.fill_(float("nan"))
        return kv

    fused_kv, plain_kv, ref_kv = cache(), cache(), cache()
    fused = qkv.clone()
    rope_qk_kv_triton_(fused, cos, sin, heads, kv_heads, head_dim, fused_kv, layer, slots)
    plain = rope_qk_triton_(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    assert torch.equal(fused, plain)
    n_q, n_kv = heads * head_dim, kv_heads * head_dim
    plain_kv.write(layer, plain[:, n_q : n_q + n_kv].reshape(T, kv_heads, head_dim),
                   plain[:, n_q + n_kv :].reshape(T, kv_heads, head_dim), slots)
    for a, b in zip(fused_kv.k + fused_kv.v, plain_kv.k + plain_kv.v):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert int(fused_kv.k[layer].isnan().sum()) == (6 * 4 - T) * kv_heads * head_dim  # only the T slots written
    ref = rope_qk_kv_ref_(qkv.clone(), cos, sin, heads, kv_heads, head_dim, ref_kv, layer, slots)
    assert same_rounding(fused, ref)
    got_k, got_v = fused_kv.read(layer, slots)
    want_k, want_v = ref_kv.read(layer, slots)
    assert same_rounding(got_k, want_k) and torch.equal(got_v, want_v)


def test_rope_with_a_cache_of_another_dtype_rotates_then_writes():
    """A float32 cache under bfloat16 activations: the launch cannot store the rotated values
    as they are, so the RoPE kernel runs alone and KVCache.write converts (the path before the
    fold): qkv as the RoPE kernel leaves it, the cache as that write makes it."""
    from mlora.batch.model.kvcache import KVCache

    heads, kv_heads, head_dim, T = 4, 2, 16, 5
    qkv = _rand(T, (heads + 2 * kv_heads) * head_dim, seed=13, dtype=torch.bfloat16, scale=2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_cos_sin(torch.tensor([1, 2, 40, 8, 300]).to(DEVICE), inv_freq.to(DEVICE), torch.bfloat16)
    slots = torch.tensor([3, 14, 0, 9, 6], device=DEVICE)
    caches = [KVCache(2, 4, 4, kv_heads, head_dim, torch.float32, DEVICE) for _ in range(2)]
    for c in caches:
        for t in c.k + c.v:
            t.fill_(float("nan"))
    got = rope_qk_kv_triton_(qkv.clone(), cos, sin, heads, kv_heads, head_dim, caches[0], 0, slots)
    want = rope_qk_triton_(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    assert torch.equal(got, want)
    n_q, n_kv = heads * head_dim, kv_heads * head_dim
    caches[1].write(0, want[:, n_q : n_q + n_kv].reshape(T, kv_heads, head_dim),
                    want[:, n_q + n_kv :].reshape(T, kv_heads, head_dim), slots)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert not caches[0].k[0].nan_to_num(0.0).eq(0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [32, 40])
def test_silu_mul_matches_the_reference(dtype, inter):
    gu = _rand(6, 2 * inter, seed=5, dtype=dtype, scale=4)
    ref = silu_mul_ref(gu, inter)
    out = silu_mul_triton(gu, inter)
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    elif dtype == torch.bfloat16 and out.device.type == "cpu":  # interpreter truncation (see same_rounding)
        assert torch.allclose(out.float(), ref.float(), rtol=2 ** -6, atol=1e-3)
    else:  # one rounding of silu and one of the product, as torch: at most one ulp apart where exp differs
        assert torch.allclose(out.float(), ref.float(), rtol=2 ** -8 if dtype == torch.bfloat16 else 2 ** -11, atol=1e-3)


def test_the_cpu_uses_the_references():
    ops = ops_for(torch.device("cpu"))
    assert not ops.fused and ops.rms_norm is rms_norm_ref
