"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) for offline batched generation.

Owns the base model: its config, its weights (fused per layer: qkv, o,
gate_up, down) and the forward pass over packed rows of many sequences with a
paged KV cache. Must not know where adapter factors live: at every fused
projection it calls ``lora.apply(layer, group, x, y)`` (``mlora.batch.model.lora``)
right after the base GEMM, and the context adds the deltas in place.

One decoder layer, in the notation of the forward pass::

    x = rmsnorm(h);   qkv = x W_qkv^T (+ b_qkv)      [lora "qkv"]
    q, k = rope(qk_norm(q)), rope(qk_norm(k))        (qk_norm: Qwen3 only)
    a = attention(q, K/V cache);  o = a W_o^T (+ b_o);  h = h + o    [lora "o" on a]
    x = rmsnorm(h);   g, u = x W_gate_up^T           [lora "gate_up"]
    m = silu(g) * u;  h = h + m W_down^T             [lora "down" on m]

(the last add happens in the next layer's input norm launch, or before the final norm; the
gate/up deltas may be added inside the SiLU product: ``lora.apply_silu_mul``)

Tensor parallelism: a model built for one rank (``tp=TPLayout(rank, size)``) holds the rank's
heads and intermediate columns (``mlora.batch.model.tp``) and a ``collective``; o and down then
give partial sums, which the layer all-reduces (o before its bias and the residual add). Without a
collective the layer runs the single-device path unchanged.

Config limits (refused with ``E_MODEL_CONFIG``, never silently approximated):
rope types other than "default" and "llama3"; a sliding window shorter than
``max_position_embeddings`` that is in use (Mistral: whenever ``sliding_window``
is set; Qwen: only with ``use_sliding_window: true``); activations other than
SiLU; MLP biases. Biases follow transformers: ``attention_bias`` gives Llama
and Qwen3 q/k/v/o biases; Qwen2 always has q/k/v biases; Mistral has none.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from mlora.batch.errors import ModelError
from mlora.batch.model.attention import AttentionMetadata, attention
from mlora.batch.model.gemms import blas_library
from mlora.batch.model.kvcache import KVCache
from mlora.batch.model.lora import LoraContext, apply_silu_mul, group_shapes
from mlora.batch.model.tp import Cut, TPLayout, shard_config, weight_cuts
from mlora.kernels.elementwise import ops_for
from mlora.kernels.elementwise import rms_norm_ref as rms_norm
from mlora.lora_tools.base import BaseCheckpointError, weight_files

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str

    @property
    def q_out(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: Mapping, generation_config: Mapping | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (transformers 4 or 5 layout) and,
        if given, ``generation_config.json`` (which wins for ``eos_token_id``)."""
        arch = _architecture(config)

        def number(name: str, default=None, kind=int):
            value = config.get(name)
            if value is None:
                value = default
            if value is None:
                raise ModelError("E_MODEL_CONFIG", f"config.json lacks {name!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ModelError("E_MODEL_CONFIG", f"{name} must be a positive integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ModelError("E_MODEL_CONFIG", f"{name} must be a positive number, got {value!r}")
            return kind(value)

        hidden = number("hidden_size")
        heads = number("num_attention_heads")
        kv_heads = number("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ModelError("E_MODEL_CONFIG", f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = config.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ModelError("E_MODEL_CONFIG", f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
            head_dim = hidden // heads
        head_dim = number("head_dim", head_dim)
        if head_dim % 2:
            raise ModelError("E_MODEL_CONFIG", f"head_dim must be even for RoPE, got {head_dim}")
        max_pos = number("max_position_embeddings")
        if config.get("hidden_act", "silu") != "silu":
            raise ModelError("E_MODEL_CONFIG", f"hidden_act {config.get('hidden_act')!r} is not supported (only 'silu')")
        if arch == "llama" and config.get("mlp_bias"):
            raise ModelError("E_MODEL_CONFIG", "mlp_bias: true is not supported")
        _check_sliding_window(arch, config, max_pos)
        # transformers reads attention_bias for Llama and Qwen3 only (q, k, v and o);
        # Qwen2 always has q/k/v biases and no o bias, Mistral has none.
        attention_bias = arch in ("llama", "qwen3") and bool(config.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(config)

        dtype = config.get("dtype", config.get("torch_dtype")) or "float32"
        if not isinstance(dtype, str):
            raise ModelError("E_MODEL_CONFIG", f"dtype must be a string, got {dtype!r}")
        gen = generation_config or {}
        eos = gen.get("eos_token_id")
        if eos is None:
            eos = config.get("eos_token_id")
        bos = config.get("bos_token_id")
        if bos is None:
            bos = gen.get("bos_token_id")
        return cls(
            arch=arch,
            vocab_size=number("vocab_size"),
            hidden_size=hidden,
            intermediate_size=number("intermediate_size"),
            num_layers=number("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps", 1e-6, float),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=attention_bias,
            qk_norm=arch == "qwen3",
            eos_token_ids=_token_ids(eos, "eos_token_id"),
            bos_token_id=bos if isinstance(bos, int) else None,
            dtype=dtype,
        )


def _architecture(config: Mapping) -> str:
    names = config.get("architectures") or []
    supported = ", ".join(ARCHITECTURES)
    if not names:
        raise ModelError("E_MODEL_ARCH", f"config.json names no architecture; supported: {supported}")
    if names[0] not in ARCHITECTURES:
        raise ModelError("E_MODEL_ARCH", f"architecture {names[0]!r} is not supported; supported: {supported}")
    return ARCHITECTURES[names[0]]


def _check_sliding_window(arch: str, config: Mapping, max_pos: int) -> None:
    window = config.get("sliding_window")
    # Qwen configs carry a window that only applies with use_sliding_window; Mistral's always applies.
    in_use = config.get("use_sliding_window", arch == "mistral")
    if window is not None and in_use and window < max_pos:
        raise ModelError("E_MODEL_CONFIG", f"sliding_window {window} < max_position_embeddings {max_pos}: "
                         "sliding-window attention is not supported yet")


def _rope(config: Mapping) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5 ``rope_parameters`` or 4's ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelError("E_MODEL_CONFIG", f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelError("E_MODEL_CONFIG", f"rope_theta must be a positive number, got {theta!r}")
    if rope_type == "default":
        return float(theta), None
    missing = [f for f in LLAMA3_ROPE_FIELDS if not isinstance(params.get(f), (int, float))]
    if missing:
        raise ModelError("E_MODEL_CONFIG", f"llama3 rope scaling lacks {', '.join(missing)}")
    if params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ModelError("E_MODEL_CONFIG", "llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return float(theta), {"rope_type": "llama3", **{f: params[f] for f in LLAMA3_ROPE_FIELDS}}


def _token_ids(value, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelError("E_MODEL_CONFIG", f"{name} must be an int or a list of ints, got {value!r}")
    return tuple(values)


def load_config(base_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a Hugging Face checkpoint directory."""
    path = os.path.join(base_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError("E_MODEL_CONFIG", f"cannot read {path}: {e}") from e
    generation = None
    gen_path = os.path.join(base_dir, "generation_config.json")
    if os.path.exists(gen_path):
        try:
            with open(gen_path) as f:
                generation = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelError("E_MODEL_CONFIG", f"cannot read {gen_path}: {e}") from e
    return ModelConfig.from_hf(config, generation)


# ---------------------------------------------------------------- math


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim / 2]: theta^(-2i/d), with llama3 frequency scaling if configured.

    llama3: wavelengths longer than original_max / low_freq_factor are slowed by
    ``factor``, shorter than original_max / high_freq_factor are kept, and the
    band between is a linear blend in (original_max / wavelength)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    original = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    slowed = inv_freq / s["factor"]
    blend = (original / wavelength - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    blended = (1 - blend) * slowed + blend * inv_freq
    out = torch.where(wavelength > original / s["low_freq_factor"], slowed, inv_freq)
    in_band = (wavelength >= original / s["high_freq_factor"]) & (wavelength <= original / s["low_freq_factor"])
    return torch.where(in_band, blended, out)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for the rotate-half layout (angles repeated over both halves)."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]: rotate pairs (i, i + d/2) by the position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# ---------------------------------------------------------------- model


class Collective(Protocol):
    """A tensor-parallel group as the model sees it (``mlora.batch.model.tpgroup.GroupCollective``)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group's ranks, in place, on every rank."""


class DecoderLayer(torch.nn.Module):
    def __init__(self, index: int, config: ModelConfig, weights: dict[str, torch.Tensor | None],
                 collective: Collective | None = None):
        """``config``: the rank's (``tp.shard_config``) when ``collective`` is a group's."""
        super().__init__()
        self.index = index
        self.config = config
        self.collective = collective
        for name, tensor in weights.items():
            self.register_buffer(name, tensor)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache, lora: LoraContext | None, delta: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream after attention, the MLP's output): the layer's output is their
        sum, which the caller forms: the next layer passes the MLP output as its ``delta`` and
        adds it in its input norm's launch (``add_rms_norm``; one element-wise pass and one
        launch fewer per layer than a separate add). ``delta`` None: ``h`` is the stream."""
        c, i, rows = self.config, self.index, h.shape[0]
        ops = ops_for(h.device)  # fused Triton element-wise kernels on CUDA, torch references elsewhere
        if delta is None:
            x = ops.rms_norm(h, self.input_norm_weight, c.rms_norm_eps)
        else:  # h + the previous layer's MLP output, then the norm
            h, x = ops.add_rms_norm(h, delta, self.input_norm_weight, c.rms_norm_eps)
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        if lora is not None:
            lora.apply(i, "qkv", x, qkv)
        if c.qk_norm:  # per-head norms before the rotation: the reference path
            q, k, v = qkv.split([c.q_out, c.kv_out, c.kv_out], dim=-1)
            q = rms_norm(q.reshape(rows, c.num_heads, c.head_dim), self.q_norm_weight, c.rms_norm_eps)
            k = rms_norm(k.reshape(rows, c.num_kv_heads, c.head_dim), self.k_norm_weight, c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.reshape(rows, c.num_kv_heads, c.head_dim)
            kv.write(i, k, v, meta.slot_mapping)
        else:  # q and k rotated in place, k and v written into the cache (one launch on CUDA)
            ops.rope_qk_kv_(qkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim, kv, i, meta.slot_mapping)
            q = qkv[:, : c.q_out].reshape(rows, c.num_heads, c.head_dim)
        a = attention(q, i, kv, meta, c.head_dim ** -0.5).reshape(rows, c.q_out)
        o = F.linear(a, self.o_weight, self.o_bias if self.collective is None else None)
        if lora is not None:
            lora.apply(i, "o", a, o)
        if self.collective is not None:  # the ranks' partials (each with its adapter slice) summed, then the bias once
            self.collective.all_reduce(o)
            if self.o_bias is not None:
                o += self.o_bias
        h, x = ops.add_rms_norm(h, o, self.post_norm_weight, c.rms_norm_eps)  # h + o, then the norm
        gate_up = F.linear(x, self.gate_up_weight)
        if lora is not None:  # the deltas, then silu(gate) * up (fused where the context can)
            m = apply_silu_mul(lora, i, x, gate_up, c.intermediate_size, ops)
        else:
            m = ops.silu_mul(gate_up, c.intermediate_size)
        down = F.linear(m, self.down_weight)
        if lora is not None:
            lora.apply(i, "down", m, down)
        if self.collective is not None:
            self.collective.all_reduce(down)
        return h, down


class DecoderModel(torch.nn.Module):
    """A Llama-family decoder with fused per-layer weights. Build it with
    ``from_pretrained`` (a Hugging Face directory) or ``from_state_dict``; with ``tp``, one
    rank's part of it (``config`` is then the rank's, ``tp`` its layout)."""

    def __init__(self, config: ModelConfig, embed_weight: torch.Tensor, norm_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, layers: list[DecoderLayer], tp: TPLayout | None = None):
        super().__init__()
        self.config = config
        self.tp = tp
        self.register_buffer("embed_weight", embed_weight)
        self.register_buffer("norm_weight", norm_weight)
        self.register_buffer("lm_head_weight", lm_head_weight)
        # a plain attribute, not a buffer: Module.to(bfloat16) must not round the frequencies
        self.inv_freq = rope_inv_freq(config).to(embed_weight.device)
        self.layers = torch.nn.ModuleList(layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def group_shapes(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        c = self.config
        return group_shapes(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype or self.dtype, self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
                lora: LoraContext | None, sample_rows: torch.Tensor) -> torch.Tensor:
        """Packed rows [T] -> logits [B, vocab] of the rows in ``sample_rows``, in the model's dtype.
        Writes every layer's K/V of the T rows into ``kv`` at ``meta.slot_mapping``."""
        kv.begin(meta.slot_mapping)  # inside a graph capture: captured, recomputed on every replay
        h = F.embedding(input_ids, self.embed_weight)
        cos, sin = rope_cos_sin(positions, self.inv_freq.to(positions.device), h.dtype)
        delta = None
        with blas_library(input_ids.shape[0], h.device):  # cuBLASLt at decode sizes (mlora.batch.model.gemms)
            for layer in self.layers:
                h, delta = layer(h, cos, sin, meta, kv, lora, delta)
            ops = ops_for(h.device)
            h = h.index_select(0, sample_rows)
            if delta is None:
                h = ops.rms_norm(h, self.norm_weight, self.config.rms_norm_eps)
            else:  # plus the last layer's MLP output, for the sampled rows only; add and norm in one launch
                delta = delta.index_select(0, sample_rows)
                _, h = ops.add_rms_norm(h, delta, self.norm_weight, self.config.rms_norm_eps)
            # in the model's dtype: the GEMM's output rounding is all there is, so a float32 copy
            # (a pass over sampled rows x vocab) would change no argmax; the sampler upcasts where it computes
            return F.linear(h, self.lm_head_weight)

    # ------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, base_dir: str | os.PathLike, device: torch.device | str = "cpu",
                        dtype: torch.dtype | str | None = None, tp: TPLayout | None = None,
                        collective: Collective | None = None) -> DecoderModel:
        """Load ``model.safetensors`` (or the shards of ``model.safetensors.index.json``)
        tensor by tensor onto ``device``, cast to ``dtype`` (default: the config's). With ``tp``,
        only the rank's part of each tensor is read (a slice of the file, never the whole tensor);
        ``collective`` is then the rank's group (required when ``tp.size > 1``)."""
        config = load_config(base_dir)
        where = _weight_files(str(base_dir))
        with ExitStack() as stack:
            handles: dict[str, object] = {}

            def handle(name: str):
                file = where[name]
                if file not in handles:
                    from safetensors import safe_open

                    handles[file] = stack.enter_context(safe_open(file, framework="pt", device=str(device)))
                return handles[file]

            def read(name: str, cut: Cut | None) -> torch.Tensor:
                if cut is None:
                    return handle(name).get_tensor(name)
                return handle(name).get_slice(name)[cut.index()]

            def shape(name: str) -> tuple[int, ...]:
                return tuple(handle(name).get_slice(name).get_shape())

            return cls._build(config, read, shape, set(where), device, dtype, tp, collective)

    @classmethod
    def from_state_dict(cls, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                        device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None,
                        tp: TPLayout | None = None, collective: Collective | None = None) -> DecoderModel:
        """Build from Hugging Face tensor names (``model.layers.0.self_attn.q_proj.weight``, ...);
        ``tp`` and ``collective`` as for ``from_pretrained`` (the rank keeps copies of its parts only)."""

        def read(name: str, cut: Cut | None) -> torch.Tensor:
            if cut is None:
                return tensors[name].to(device)
            return cut.take(tensors[name]).to(device).clone(memory_format=torch.contiguous_format)

        return cls._build(config, read, lambda name: tuple(tensors[name].shape), set(tensors), device, dtype,
                          tp, collective)

    @classmethod
    def _build(cls, config: ModelConfig, read: Callable[[str, Cut | None], torch.Tensor],
               shape_of: Callable[[str], tuple[int, ...]], names: set[str], device: torch.device | str,
               dtype: torch.dtype | str | None, tp: TPLayout | None, collective: Collective | None) -> DecoderModel:
        """``read(name, cut)``: the tensor, or the cut of it; ``shape_of(name)``: its whole shape."""
        dtype = _resolve_dtype(dtype if dtype is not None else config.dtype)
        device = torch.device(device)
        if tp is not None and tp.size > 1 and collective is None:
            raise ModelError("E_TP_LAYOUT", f"rank {tp.rank} of {tp.size} needs its group's collective "
                                            "(mlora.batch.model.tpgroup) to sum the row-parallel partials")
        c = config  # the checkpoint's shapes, checked whole
        local = c if tp is None else shard_config(c, tp)  # the rank's part of them
        cuts: dict[str, Cut] = {} if tp is None or tp.size == 1 else weight_cuts(c, tp)

        def load(name: str, shape: tuple[int, ...], out: torch.Tensor | None = None,
                 cut: Cut | None = None) -> torch.Tensor:
            if name not in names:
                raise ModelError("E_MODEL_WEIGHTS", f"checkpoint lacks tensor {name!r}")
            if shape_of(name) != shape:
                raise ModelError("E_MODEL_WEIGHTS", f"tensor {name!r} has shape {shape_of(name)}, expected {shape}")
            t = read(name, cut)
            if out is None:
                return t.to(device=device, dtype=dtype)
            out.copy_(t)
            return out

        def fused(parts: list[tuple[str, tuple[int, ...], Cut | None]]) -> torch.Tensor:
            """Stack row blocks (each the rank's rows) into one tensor, one source block in memory at a time."""
            sizes = [shape[0] if cut is None else cut.length for _, shape, cut in parts]
            out = torch.empty((sum(sizes), *parts[0][1][1:]), dtype=dtype, device=device)
            start = 0
            for (name, shape, cut), rows in zip(parts, sizes):
                load(name, shape, out[start:start + rows], cut)
                start += rows
            return out

        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            qkv_rows = [(attn + r, n, cuts.get(r)) for r, n in (("q_proj", c.q_out), ("k_proj", c.kv_out),
                                                                 ("v_proj", c.kv_out))]
            gate_up = [(mlp + r + ".weight", (c.intermediate_size, c.hidden_size), cuts.get(r))
                       for r in ("gate_proj", "up_proj")]
            w = {
                "qkv_weight": fused([(n + ".weight", (r, c.hidden_size), cut) for n, r, cut in qkv_rows]),
                "qkv_bias": fused([(n + ".bias", (r,), cut) for n, r, cut in qkv_rows]) if c.qkv_bias else None,
                "o_weight": load(attn + "o_proj.weight", (c.hidden_size, c.q_out), cut=cuts.get("o_proj")),
                "o_bias": load(attn + "o_proj.bias", (c.hidden_size,)) if c.o_bias else None,
                "gate_up_weight": fused(gate_up),
                "down_weight": load(mlp + "down_proj.weight", (c.hidden_size, c.intermediate_size),
                                    cut=cuts.get("down_proj")),
                "input_norm_weight": load(p + "input_layernorm.weight", (c.hidden_size,)),
                "post_norm_weight": load(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                "q_norm_weight": load(attn + "q_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                "k_norm_weight": load(attn + "k_norm.weight", (c.head_dim,)) if c.qk_norm else None,
            }
            layers.append(DecoderLayer(i, local, w, collective if cuts else None))
        embed = load("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        norm = load("model.norm.weight", (c.hidden_size,))
        lm_head = embed if c.tie_word_embeddings else load("lm_head.weight", (c.vocab_size, c.hidden_size))
        return cls(local, embed, norm, lm_head, layers, tp)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelError("E_MODEL_CONFIG", f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ModelError("E_MODEL_CONFIG", f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _weight_files(base_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file, as ``mlora.lora_tools.base.weight_files`` places them
    (the one reading of a checkpoint's layout: an mlora release's own record, the shard index,
    or the single file)."""
    try:
        shards, weight_map = weight_files(base_dir)
    except BaseCheckpointError as e:
        raise ModelError("E_MODEL_WEIGHTS", str(e)) from None
    if weight_map is not None:
        return {name: os.path.join(base_dir, file) for name, file in weight_map.items()}
    single = os.path.join(base_dir, shards[0])
    from safetensors import safe_open

    try:
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ModelError("E_MODEL_WEIGHTS", f"cannot read {single}: {e}") from e
