"""Stable finding codes for adapter and base validation.

Owns the code registry: every code's severity and the advice that tells the
user what to do. Codes are a public contract (tests, CI scripts and the JSON
manifest use them); never rename or reuse one.

Severities:

* ``error``: the artifact is not a valid PEFT LoRA adapter (or does not fit the
  given base); mlora refuses it.
* ``unservable``: valid PEFT, but it uses a feature mlora cannot serve; mlora
  refuses to serve it rather than serve something else.
* ``warning``: valid and servable, but suspicious; ``--strict`` makes it fail.
* ``info``: valid and servable; says how mlora serves it. Never fails, not even with ``--strict``.
"""

from __future__ import annotations

from dataclasses import dataclass

ERROR = "error"
UNSERVABLE = "unservable"
WARNING = "warning"
INFO = "info"

# code -> (severity, advice appended to every message of that code)
CODES: dict[str, tuple[str, str]] = {
    # artifact layout and config
    "E_NOT_AN_ADAPTER": (ERROR, "pass a PEFT adapter directory (with adapter_config.json) or a directory of them"),
    "E_CONFIG_MISSING": (ERROR, "add the adapter_config.json written by PEFT's save_pretrained"),
    "E_CONFIG_PARSE": (ERROR, "adapter_config.json must be one JSON object; re-save the adapter with PEFT"),
    "E_CONFIG_TYPE": (ERROR, "mlora reads LoRA adapters only (peft_type \"LORA\")"),
    "E_CONFIG_FIELD": (ERROR, "fix the field in adapter_config.json; PEFT would reject or misread it too"),
    "E_ALORA_INVOCATION": (ERROR, "set alora_invocation_tokens to the non-empty list of token ids (integers from 0 to the vocabulary size - 1) that the base's tokenizer gives for the invocation string, or remove it for an ordinary LoRA"),
    "E_WEIGHTS_MISSING": (ERROR, "add adapter_model.safetensors written by PEFT's save_pretrained"),
    "E_PICKLE_REFUSED": (ERROR, "convert it to adapter_model.safetensors, or pass --allow-pickle if you trust the file"),
    "E_PICKLE_LOAD": (ERROR, "the pickle could not be read with torch.load(weights_only=True); re-save as safetensors"),
    # safetensors file
    "E_SAFETENSORS_TRUNCATED": (ERROR, "the file is shorter than its header says; copy it again from the source"),
    "E_SAFETENSORS_HEADER": (ERROR, "the safetensors header is malformed; re-save the file with the safetensors library"),
    # tensors
    "E_UNSUPPORTED_DTYPE": (ERROR, "store LoRA factors as float32, float16 or bfloat16"),
    "E_EMPTY_TENSOR": (ERROR, "a factor with zero elements cannot be served; re-export the adapter"),
    "E_NON_FINITE": (ERROR, "the factor holds NaN or Inf; the training diverged or the file is corrupt"),
    "E_MISSING_PARTNER": (ERROR, "every lora_A needs its lora_B (and back); the file is incomplete"),
    "E_UNEXPECTED_KEY": (ERROR, "mlora cannot interpret this tensor and will not ignore it; remove it or re-save with PEFT"),
    "E_FACTOR_SHAPE": (ERROR, "lora_A must be [r, d_in] and lora_B [d_out, r] with the same r"),
    "E_RANK_MISMATCH": (ERROR, "the stored factor rank differs from r / rank_pattern in adapter_config.json; fix the config or the file"),
    "E_DTYPE_MISMATCH": (ERROR, "lora_A and lora_B of one module must share a dtype"),
    "E_NO_MODULES": (ERROR, "the adapter contains no LoRA factors"),
    # against a base checkpoint
    "E_BASE_INVALID": (ERROR, "pass a Hugging Face model directory with config.json and safetensors weights"),
    "E_TARGET_NOT_IN_BASE": (ERROR, "the adapter targets a module the base does not have; is it for another base model?"),
    "E_BASE_SHAPE_MISMATCH": (ERROR, "the factor shapes do not fit the base weight; the adapter was trained on another base"),
    # valid PEFT, not servable by mlora
    "U_DORA": (UNSERVABLE, "DoRA (use_dora) is not served or merged by mlora yet; retrain without DoRA, or merge it with PEFT's merge_and_unload"),
    "U_LORA_BIAS": (UNSERVABLE, "lora_bias adds a bias to lora_B; mlora does not serve it"),
    "U_BIAS": (UNSERVABLE, "the file holds base biases trained with bias != \"none\"; mlora serves the unchanged base only"),
    "U_MODULES_TO_SAVE": (UNSERVABLE, "modules_to_save replaces whole base modules; ship a merged release instead"),
    "U_EMBEDDING_LORA": (UNSERVABLE, "LoRA on embedding layers is not served by mlora; target linear projections"),
    "U_TARGET_PARAMETERS": (UNSERVABLE, "target_parameters (LoRA on raw parameters, e.g. MoE experts) is not served by mlora"),
    "U_LAYER_REPLICATION": (UNSERVABLE, "layer_replication changes the base architecture; mlora does not serve it"),
    "U_INIT_CHANGES_BASE": (UNSERVABLE, "this init (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) changes the base weights; convert it to a plain LoRA with PEFT's path_initial_model_for_weight_conversion"),
    "U_TRAINABLE_TOKENS": (UNSERVABLE, "trainable_token_indices changes embedding rows; mlora does not serve it"),
    "U_FAN_IN_FAN_OUT": (UNSERVABLE, "fan_in_fan_out (Conv1D bases such as GPT-2) is not served by mlora yet"),
    "U_FEATURE": (UNSERVABLE, "this PEFT LoRA variant is not served by mlora"),
    # warnings
    "W_CONFIG_UNKNOWN_FIELD": (WARNING, "mlora does not know this field; check that it does not change the adapter's math"),
    "W_PATTERN_UNMATCHED": (WARNING, "PEFT ignores such a key silently; fix or remove it"),
    "W_BIAS_INERT": (WARNING, "without bias tensors the config's bias field changes nothing: the adapter is served as the plain LoRA it holds; set bias to \"none\" to silence this"),
    "W_ZERO_DELTA": (WARNING, "this module changes nothing; was the adapter trained?"),
    "W_BASE_NAME_MISMATCH": (WARNING, "the adapter declares another base; check that it was trained on this one"),
    "W_TARGET_SET_MISMATCH": (WARNING, "the config and the stored factors disagree on which modules are adapted"),
    # information
    "I_ALORA": (INFO, "activated LoRA: batch-run applies it from the last occurrence of these tokens in the prompt on and the base before it, as PEFT does (a prompt without them: --alora-without-invocation); mlora merge and mlora compress refuse it"),
}


@dataclass(frozen=True)
class Finding:
    """One validation result: a stable ``code``, its severity, the canonical
    module it is about (or None for the whole artifact) and a message that ends
    with what to do."""

    code: str
    severity: str
    module: str | None
    message: str

    def to_json(self) -> dict:
        return {"code": self.code, "severity": self.severity, "module": self.module, "message": self.message}


def finding(code: str, detail: str, module: str | None = None) -> Finding:
    """Build a finding for a registered code; ``detail`` says what was seen."""
    severity, advice = CODES[code]
    return Finding(code=code, severity=severity, module=module, message=f"{detail}: {advice}")


def findings_doc() -> str:
    """docs/findings.md, generated from CODES (``python -m mlora.lora_tools.findings``)."""
    lines = [
        "# Finding codes",
        "",
        "Generated from `mlora/lora_tools/findings.py` by `python -m mlora.lora_tools.findings > docs/findings.md`;",
        "a test keeps the two equal. Codes are stable: never renamed, never reused.",
        "",
        "Severity decides the exit code of `mlora validate`: `error` and `unservable` fail (exit 1),",
        "`warning` fails only with `--strict`, `info` never fails.",
        "",
        "| code | severity | what to do |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{code}` | {sev} | {advice.replace('|', '/')} |" for code, (sev, advice) in CODES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(findings_doc(), end="")
