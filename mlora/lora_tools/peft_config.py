"""PEFT ``LoraConfig`` parsing and PEFT's per-module resolution rules.

Owns the meaning of ``adapter_config.json``: field types, defaults, and how
PEFT resolves target modules, layer filters, ``rank_pattern`` /
``alpha_pattern`` and the scaling rule for one module name. Must not read
tensors or files: the adapter reader hands it the parsed JSON.

Resolution follows PEFT (0.13 to 0.21) exactly:

* rank/alpha: the first key, in dict order, of ``rank_pattern`` (resp.
  ``alpha_pattern``) for which ``re.match(rf"(.*\\.)?({key})$", name)``
  matches; otherwise ``r`` (resp. ``lora_alpha``). r and alpha resolve
  independently.
* scale: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``.
* targets: ``exclude_modules`` first (regex full match, or exact / ``.suffix``
  list match), then ``target_modules`` (string: regex full match; list: exact
  name or ``.suffix`` match, then the ``layers_to_transform`` filter).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mlora.lora_tools.canonical import canonicalize_floats
from mlora.lora_tools.findings import Finding, finding

ALL_LINEAR = "all-linear"

# Every LoraConfig field of PEFT 0.21 (and a few of older releases). Anything
# else in adapter_config.json draws W_CONFIG_UNKNOWN_FIELD.
KNOWN_FIELDS = frozenset(
    """task_type peft_type auto_mapping peft_version base_model_name_or_path revision inference_mode r
    target_modules exclude_modules lora_alpha lora_dropout fan_in_fan_out bias use_rslora modules_to_save
    init_lora_weights layers_to_transform layers_pattern rank_pattern alpha_pattern megatron_config
    megatron_core trainable_token_indices loftq_config eva_config corda_config lora_ga_config use_dora
    velora_config alora_invocation_tokens use_qalora qalora_group_size monteclora_config layer_replication
    runtime_config lora_bias target_parameters use_bdlora arrow_config kasa_config ensure_weight_tying""".split()
)

# init_lora_weights values whose saved factors only make sense with a changed base.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "lora-ga")

# Fields that select a LoRA variant mlora does not execute: truthy -> U_FEATURE.
_VARIANT_FIELDS = (
    "use_qalora", "use_bdlora", "arrow_config", "kasa_config", "monteclora_config", "velora_config",
)


@dataclass(frozen=True)
class LoraSpec:
    """The math-relevant content of one adapter_config.json, typed."""

    r: int
    lora_alpha: float | int
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float | int]
    target_modules: list[str] | str | None
    exclude_modules: list[str] | str | None
    layers_to_transform: list[int] | int | None
    layers_pattern: list[str] | str | None
    fan_in_fan_out: bool
    bias: str
    modules_to_save: list[str] | None
    use_dora: bool
    lora_bias: bool
    init_lora_weights: bool | str
    alora_invocation_tokens: list[int] | None
    target_parameters: list[str] | None
    layer_replication: list | None
    trainable_token_indices: Any
    base_model_name_or_path: str | None
    revision: str | None
    raw: dict

    # ---- per-module resolution -------------------------------------------------

    def rank_for(self, name: str) -> int:
        key = pattern_key(self.rank_pattern, name)
        return self.rank_pattern[key] if key is not None else self.r

    def alpha_for(self, name: str) -> float | int:
        key = pattern_key(self.alpha_pattern, name)
        return self.alpha_pattern[key] if key is not None else self.lora_alpha

    @property
    def scale_rule(self) -> str:
        return "alpha/sqrt(r)" if self.use_rslora else "alpha/r"

    def scale(self, rank: int, alpha: float | int) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, name: str) -> bool:
        """True when PEFT would put a LoRA layer on module ``name``."""
        return module_is_targeted(self, name)

    # ---- servability -----------------------------------------------------------

    def unservable_findings(self) -> list[Finding]:
        """The features the config alone makes unservable. ``bias`` is not one: whether it
        trained anything depends on the tensors the file holds (the adapter reader judges it)."""
        out = []
        if self.use_dora:
            out.append(finding("U_DORA", "use_dora is true"))
        if self.lora_bias:
            out.append(finding("U_LORA_BIAS", "lora_bias is true"))
        if self.modules_to_save:
            out.append(finding("U_MODULES_TO_SAVE", f"modules_to_save is {self.modules_to_save}"))
        if self.target_parameters:
            out.append(finding("U_TARGET_PARAMETERS", f"target_parameters is {self.target_parameters}"))
        if self.layer_replication:
            out.append(finding("U_LAYER_REPLICATION", "layer_replication is set"))
        if self.trainable_token_indices:
            out.append(finding("U_TRAINABLE_TOKENS", "trainable_token_indices is set"))
        if isinstance(self.init_lora_weights, str) and self.init_lora_weights.lower().startswith(_BASE_CHANGING_INITS):
            out.append(finding("U_INIT_CHANGES_BASE", f"init_lora_weights is {self.init_lora_weights!r}"))
        elif self.raw.get("lora_ga_config"):
            out.append(finding("U_INIT_CHANGES_BASE", "lora_ga_config is set"))
        if self.fan_in_fan_out:
            out.append(finding("U_FAN_IN_FAN_OUT", "fan_in_fan_out is true"))
        for name in _VARIANT_FIELDS:
            if self.raw.get(name):
                out.append(finding("U_FEATURE", f"{name} is set"))
        return out

    def info_findings(self) -> list[Finding]:
        """What the config says about how a servable adapter is served (never a refusal)."""
        if self.alora_invocation_tokens:
            return [finding("I_ALORA", f"alora_invocation_tokens is {self.alora_invocation_tokens}")]
        return []

    # ---- identity projections --------------------------------------------------

    def semantic_projection(self) -> dict:
        """The config fields that change the adapter's math and are not already
        resolved into per-module records (rank, alpha and targets are: they live
        in the module specs). Hashed as ``peft_config_sha256``."""
        init = self.init_lora_weights
        base_changing = isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS)
        return canonicalize_floats(
            {
                "peft_type": "LORA",
                "use_rslora": self.use_rslora,
                "fan_in_fan_out": self.fan_in_fan_out,
                "bias": self.bias,
                "use_dora": self.use_dora,
                "lora_bias": self.lora_bias,
                "modules_to_save": sorted(self.modules_to_save or []),
                "target_parameters": sorted(self.target_parameters or []),
                "layer_replication": self.layer_replication or None,
                "trainable_token_indices": self.trainable_token_indices or None,
                "base_changing_init": init if base_changing else None,
                "variants": {n: self.raw[n] for n in _VARIANT_FIELDS if self.raw.get(n)},
            }
        )

    def activation_policy(self) -> dict:
        """Always-on LoRA, or aLoRA activated after its invocation tokens (docs/identity.md, Activation policy)."""
        if self.alora_invocation_tokens:
            return {"kind": "alora", "invocation_tokens": list(self.alora_invocation_tokens)}
        return {"kind": "always_on"}


def pattern_key(patterns: dict[str, Any], name: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first key (dict order) matching ``name``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def module_is_targeted(spec: LoraSpec, name: str, linear_names: frozenset[str] | None = None) -> bool:
    """PEFT's ``check_target_module_exists`` for plain (non-parameter) targets.

    ``linear_names`` resolves the ``"all-linear"`` shorthand: the base's linear
    modules minus its output layer (PEFT computes the same set from the model)."""
    ex = spec.exclude_modules
    if ex:
        if isinstance(ex, str):
            if re.fullmatch(ex, name):
                return False
        elif name in ex or any(name.endswith(f".{k}") for k in ex):
            return False
    if spec.modules_to_save and any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in spec.modules_to_save):
        return False
    tm = spec.target_modules
    if tm is None:
        return False
    if isinstance(tm, str):
        if tm.lower() == ALL_LINEAR:
            return linear_names is not None and name in linear_names
        return re.fullmatch(tm, name) is not None
    if name in tm:
        return True
    if not any(name.endswith(f".{k}") for k in tm):
        return False
    return _layer_filter(spec, name)


def _layer_filter(spec: LoraSpec, name: str) -> bool:
    idx = spec.layers_to_transform
    if idx is None or (isinstance(idx, list) and not idx):
        return True
    pats = spec.layers_pattern
    if not pats:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        m = None
        for p in [pats] if isinstance(pats, str) else pats:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)
            if m:
                break
    if m is None:
        return False
    layer = int(m.group("idx"))
    return layer == idx if isinstance(idx, int) else layer in idx


def layer_index(name: str) -> int | None:
    """The first numbered path segment (PEFT's default layer regex), or None."""
    m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name + ".")
    return int(m.group("idx")) if m else None


# ---- parsing -------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


class _FieldError(Exception):
    def __init__(self, message: str, code: str = "E_CONFIG_FIELD"):
        super().__init__(message)
        self.code = code


def _field(raw: dict, name: str, default: Any, ok, expect: str) -> Any:
    value = raw.get(name, default)
    if not ok(value):
        raise _FieldError(f"{name} must be {expect}, got {value!r}")
    return value


def _invocation_tokens(raw: dict) -> list[int] | None:
    """aLoRA's invocation: None (an ordinary LoRA) or a non-empty list of token ids. PEFT takes any
    list of integers: an empty one silently serves an ordinary LoRA, a negative id never occurs in
    a prompt; both are refused rather than guessed at."""
    value = raw.get("alora_invocation_tokens")
    if value is None:
        return None
    if not (isinstance(value, list) and value and all(_is_int(x) and x >= 0 for x in value)):
        raise _FieldError(f"alora_invocation_tokens must be a non-empty list of non-negative integers, "
                          f"got {value!r}", "E_ALORA_INVOCATION")
    return value


def parse_lora_config(raw: Any) -> tuple[LoraSpec | None, list[Finding]]:
    """Type-check an adapter_config.json object. Returns (spec, findings);
    spec is None when the config cannot be interpreted."""
    if not isinstance(raw, dict):
        return None, [finding("E_CONFIG_PARSE", "adapter_config.json is not a JSON object")]
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        return None, [finding("E_CONFIG_TYPE", f"peft_type is {peft_type!r}")]
    findings = [
        finding("W_CONFIG_UNKNOWN_FIELD", f"unknown field {k!r}") for k in raw if k not in KNOWN_FIELDS
    ]
    none_or = lambda pred: (lambda v: v is None or pred(v))  # noqa: E731
    try:
        r = _field(raw, "r", 8, lambda v: _is_int(v) and v > 0, "a positive integer")
        alpha = _field(raw, "lora_alpha", 8, _is_real, "a finite number")
        rank_pattern = _field(
            raw, "rank_pattern", {}, none_or(lambda d: isinstance(d, dict) and all(_is_int(x) and x > 0 for x in d.values())),
            "an object of positive integers",
        ) or {}
        alpha_pattern = _field(
            raw, "alpha_pattern", {}, none_or(lambda d: isinstance(d, dict) and all(_is_real(x) for x in d.values())),
            "an object of finite numbers",
        ) or {}
        for key in list(rank_pattern) + list(alpha_pattern):
            try:
                re.compile(key)
            except re.error as exc:
                raise _FieldError(f"pattern key {key!r} is not a regular expression ({exc})") from None
        targets = _field(raw, "target_modules", None, none_or(lambda v: isinstance(v, str) or _is_str_list(v)),
                         "a list of names or a regex string")
        exclude = _field(raw, "exclude_modules", None, none_or(lambda v: isinstance(v, str) or _is_str_list(v)),
                         "a list of names or a regex string")
        for pat in [p for p in (targets, exclude) if isinstance(p, str) and p.lower() != ALL_LINEAR]:
            try:
                re.compile(pat)
            except re.error as exc:
                raise _FieldError(f"regex {pat!r} does not compile ({exc})") from None
        layers = _field(raw, "layers_to_transform", None,
                        none_or(lambda v: _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v))),
                        "an integer or a list of integers")
        layers_pattern = _field(raw, "layers_pattern", None, none_or(lambda v: isinstance(v, str) or _is_str_list(v)),
                                "a string or a list of strings")
        spec = LoraSpec(
            r=r,
            lora_alpha=alpha,
            use_rslora=_field(raw, "use_rslora", False, lambda v: isinstance(v, bool), "true or false"),
            rank_pattern=dict(rank_pattern),
            alpha_pattern=dict(alpha_pattern),
            target_modules=targets,
            exclude_modules=exclude,
            layers_to_transform=layers,
            layers_pattern=layers_pattern,
            fan_in_fan_out=_field(raw, "fan_in_fan_out", False, lambda v: isinstance(v, bool), "true or false"),
            bias=_field(raw, "bias", "none", lambda v: v in ("none", "all", "lora_only"), '"none", "all" or "lora_only"'),
            modules_to_save=_field(raw, "modules_to_save", None, none_or(_is_str_list), "a list of names"),
            use_dora=_field(raw, "use_dora", False, lambda v: isinstance(v, bool), "true or false"),
            lora_bias=_field(raw, "lora_bias", False, lambda v: isinstance(v, bool), "true or false"),
            init_lora_weights=_field(raw, "init_lora_weights", True, lambda v: isinstance(v, (bool, str)),
                                     "a boolean or a method name"),
            alora_invocation_tokens=_invocation_tokens(raw),
            target_parameters=_field(raw, "target_parameters", None, none_or(_is_str_list), "a list of names"),
            layer_replication=_field(raw, "layer_replication", None, none_or(lambda v: isinstance(v, list)), "a list"),
            trainable_token_indices=raw.get("trainable_token_indices"),
            base_model_name_or_path=_field(raw, "base_model_name_or_path", None, none_or(lambda v: isinstance(v, str)),
                                           "a string"),
            revision=_field(raw, "revision", None, none_or(lambda v: isinstance(v, str)), "a string"),
            raw=raw,
        )
    except _FieldError as exc:
        return None, findings + [finding(exc.code, str(exc))]
    return spec, findings
