"""The seam between the model and the adapter slot bank.

Owns the grouping of LoRA target modules into fused launches and the protocol
the model calls at every target module. The model never knows where adapter
factors live; the banks (``mlora.batch.adapters.slots``, the residency engine's bank)
never know the model's layer code.

Groups (one fused shrink + expand launch each, ``add_lora_slices``)::

    "qkv"     slices q_proj, k_proj, v_proj   input hidden        widths q_out, kv_out, kv_out
    "o"       slice  o_proj                   input q_out         width  hidden
    "gate_up" slices gate_proj, up_proj       input hidden        widths inter, inter
    "down"    slice  down_proj                input inter         width  hidden

``LoraContext.apply(layer, group, x, y)`` adds, in place, the LoRA deltas of
every row of ``x`` (packed rows of this model invocation) to ``y``, the base
output of the fused group (columns laid out slice after slice, as above).
Rows whose adapter does not target a slice are left untouched there.
"""

from __future__ import annotations

from typing import Protocol

import torch

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

# role -> (group, slice index)
ROLE_SLICE: dict[str, tuple[str, int]] = {role: (g, j) for g, roles in GROUPS.items() for j, role in enumerate(roles)}


def module_layer_role(name: str) -> tuple[int | None, str]:
    """(layer, role) of a bundle's module name ``model.layers.<i>.<block>.<role>``; layer is
    None for any other shape (the caller refuses such a module)."""
    parts = name.split(".")
    layer = int(parts[2]) if len(parts) == 5 and parts[2].isdigit() else None
    return layer, parts[-1]


def module_name(layer: int, role: str) -> str:
    """The Hugging Face name ``model.layers.<layer>.<block>.<role>`` of a target module (the
    inverse of :func:`module_layer_role`): q/k/v/o under ``self_attn``, gate/up/down under ``mlp``."""
    block = "self_attn" if ROLE_SLICE[role][0] in ("qkv", "o") else "mlp"
    return f"model.layers.{layer}.{block}.{role}"


def held_slices(roles) -> dict[str, tuple[int, ...]]:
    """group -> the slice indices (into ``GROUPS[group]``) of the given target roles, for the
    groups any of them is in: what a slot bank must hold for adapters targeting ``roles``."""
    held: dict[str, set[int]] = {}
    for role in roles:
        g, j = ROLE_SLICE[role]
        held.setdefault(g, set()).add(j)
    return {g: tuple(sorted(held[g])) for g in GROUPS if g in held}


def group_shapes(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """group -> (d_in, slice widths) for a Llama-family decoder layer."""
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "qkv": (hidden, (q_out, kv_out, kv_out)),
        "o": (q_out, (hidden,)),
        "gate_up": (hidden, (intermediate, intermediate)),
        "down": (intermediate, (hidden,)),
    }


def role_shapes(shapes: dict[str, tuple[int, tuple[int, ...]]]) -> dict[str, tuple[int, int]]:
    """role -> (d_out, d_in) of every target module of :func:`group_shapes`' groups."""
    return {role: (widths[j], d_in) for g, (d_in, widths) in shapes.items() for j, role in enumerate(GROUPS[g])}


def config_role_shapes(config) -> dict[str, tuple[int, int]]:
    """role -> (d_out, d_in) for a ``mlora.batch.model.decoder.ModelConfig``."""
    c = config
    return role_shapes(group_shapes(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim))


class LoraContext(Protocol):
    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the LoRA deltas of this invocation's rows to ``y`` in place."""


def apply_silu_mul(lora, layer: int, x: torch.Tensor, gate_up: torch.Tensor, inter: int, ops) -> torch.Tensor:
    """The MLP's activation after its gate/up LoRA: ``ops.silu_mul`` of ``gate_up`` plus the
    deltas. A context with ``apply_silu_mul`` (``BankContext``) may fuse the two (it may then
    leave ``gate_up`` without the deltas); any other adds them with ``apply`` first."""
    fused = getattr(lora, "apply_silu_mul", None)
    if fused is not None:
        return fused(layer, x, gate_up, inter, ops)
    lora.apply(layer, "gate_up", x, gate_up)
    return ops.silu_mul(gate_up, inter)
