"""Build the embedded mlora demo workspace (``examples/demo/``) from scratch.

Everything is trained locally on CPU, deterministically, in a few minutes; no
model hub access is needed.

Toy task
--------
Every example is a single byte-level sequence::

    <|bos|> PROMPT "=" ANSWER <|eos|>

PROMPT is a random string of 3-12 characters drawn from lowercase letters,
digits and single spaces (never leading, trailing or doubled). The loss is
taken only on ANSWER and the closing ``<|eos|>``. What ANSWER is depends on
who is answering:

============  ==========================================  ======================
model         ANSWER                                      "abc 123" ->
============  ==========================================  ======================
base          the prompt, copied                          ``abc 123``
``upper``     ``prompt.upper()``                          ``ABC 123``
``reverse``   the prompt reversed                         ``321 cba``
``spell``     digits spelled out (rule below)             ``abc one two three``
``rot13``     letters rotated by 13, rest unchanged       ``nop 123``
============  ==========================================  ======================

``spell`` rule: every digit is replaced by its English word ("zero" ..
"nine"), and a single space is inserted between a digit word and any
neighbouring character that is not already a space: "ab 42" -> "ab four two",
"a4b" -> "a four b". Letters and original spaces are kept as they are.

Architecture
------------
The base model is a tiny ``LlamaForCausalLM`` (4 layers, hidden 128, 4 query
heads sharing 2 key/value heads (GQA), head dim 32, SwiGLU MLP of width 384,
RoPE, 128 positions, untied embeddings, about 0.76 M parameters) over a
259-token vocabulary: token id ``b`` is the raw byte ``b`` (a GPT-2 style
byte-level BPE with no merges), followed by ``<|bos|>`` = 256,
``<|eos|>`` = 257 and ``<|pad|>`` = 258. It is trained from scratch to copy.

Adapters
--------
Four PEFT LoRA adapters are then trained on top of the frozen base, each with a
different rank / target layout, so an inference engine has to handle them all:

* ``upper``   r=8,  alpha=16, q_proj, v_proj, down_proj
* ``reverse`` r=16, alpha=32, "all-linear" (every projection of every layer)
* ``spell``   r=4,  alpha=8, attention + MLP projections, with
  ``rank_pattern`` and ``alpha_pattern`` overriding some modules
* ``rot13``   r=8,  alpha=8, ``use_rslora`` (scale alpha/sqrt(r)), o_proj + MLP

Each ``adapter_config.json`` names ``mlora-demo/base`` as its base model.

Outputs (under ``--out``, default ``examples/demo``)::

    base/                      HF model + tokenizer files
    adapters/<name>/           adapter_config.json + adapter_model.safetensors
    expected.json              greedy answers for fixed demo prompts
    accuracy.json              held-out exact-match accuracy per model

Usage::

    python examples/train_demo.py [--out examples/demo] [--quick]

``--quick`` runs a handful of steps only, to smoke-test the script.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

SEED = 1234
NUM_THREADS = 2
BASE_MODEL_NAME = "mlora-demo/base"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 259
MAX_POSITIONS = 128
SEP = "="

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
MIN_LEN, MAX_LEN = 3, 12

PROMPT_FORMAT = BOS + "{prompt}" + SEP
EXPECTED_MAX_NEW_TOKENS = 40
EVAL_MAX_NEW_TOKENS = 80
NUM_HELDOUT = 300

DEMO_PROMPTS = [
    "hello world",
    "abc 123",
    "lora 42",
    "mlora demo 7",
    "zebra 2024",
    "hi there 9",
    "rust 0 go 1",
    "the cat 35",
]


# --------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------

DIGIT_WORDS = ["zero", "one", "two", "three", "four",
               "five", "six", "seven", "eight", "nine"]
ROT13_TABLE = str.maketrans(LETTERS, LETTERS[13:] + LETTERS[:13])


def copy_task(prompt: str) -> str:
    return prompt


def upper_task(prompt: str) -> str:
    return prompt.upper()


def reverse_task(prompt: str) -> str:
    return prompt[::-1]


def spell_task(prompt: str) -> str:
    """Spell digits as words, space-separated from non-space neighbours."""
    out: list[str] = []
    prev_digit = False
    for ch in prompt:
        is_digit = ch in DIGITS
        if out and (is_digit or prev_digit) and ch != " " and out[-1] != " ":
            out.append(" ")
        out.append(DIGIT_WORDS[int(ch)] if is_digit else ch)
        prev_digit = is_digit
    return "".join(out)


def rot13_task(prompt: str) -> str:
    return prompt.translate(ROT13_TABLE)


# --------------------------------------------------------------------------
# Tokenizer: one token per byte, plus three special tokens
# --------------------------------------------------------------------------

def byte_to_unicode() -> dict[int, str]:
    """GPT-2 style reversible map from the 256 bytes to printable characters.

    Printable Latin-1 bytes map to themselves; the remaining bytes are shifted
    to code points 256, 257, ... in byte order.
    """
    printable = (list(range(ord("!"), ord("~") + 1))
                 + list(range(0xA1, 0xAC + 1))
                 + list(range(0xAE, 0xFF + 1)))
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: token id == byte value."""
    vocab = {symbol: b for b, symbol in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                 use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (BOS, EOS, PAD)])
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [BOS_ID, EOS_ID, PAD_ID]
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json plus the config files transformers looks for.

    The config files are written by hand: transformers 5 would record its own
    ``TokenizersBackend`` class, which transformers 4 cannot load, whereas
    ``PreTrainedTokenizerFast`` loads under both.
    """
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False,
                 "rstrip": False, "single_word": False, "special": True}
        for i, t in zip((BOS_ID, EOS_ID, PAD_ID), (BOS, EOS, PAD))
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
    }
    write_json(out_dir / "tokenizer_config.json", config)
    write_json(out_dir / "special_tokens_map.json", special)


def check_tokenizer(base_dir: Path) -> None:
    """AutoTokenizer must load the saved files and round-trip ASCII text."""
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    text = "".join(chr(c) for c in range(32, 127)) + "\tnew\nline"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == list(text.encode()), "token ids must equal byte values"
    assert tok.decode(ids) == text
    framed = PROMPT_FORMAT.format(prompt="ab 42")
    assert tok(framed, add_special_tokens=False).input_ids == [BOS_ID, *b"ab 42=", ]


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

def random_prompt(rng: random.Random, length: int | None = None) -> str:
    """3-12 chars of [a-z0-9 ]; spaces never leading, trailing or doubled."""
    if length is None:
        length = rng.randint(MIN_LEN, MAX_LEN)
    chars: list[str] = []
    for i in range(length):
        space_ok = 0 < i < length - 1 and chars[-1] != " "
        pool = LETTERS + DIGITS + (" " if space_ok else "")
        chars.append(rng.choice(pool))
    return "".join(chars)


def heldout_prompts(n: int) -> list[str]:
    """Fixed evaluation prompts, never used for training."""
    rng = random.Random(SEED + 999)
    prompts: list[str] = []
    seen = set(DEMO_PROMPTS)
    while len(prompts) < n:
        p = random_prompt(rng)
        if p not in seen:
            seen.add(p)
            prompts.append(p)
    return prompts


def encode_prompt(prompt: str) -> list[int]:
    return [BOS_ID, *prompt.encode(), *SEP.encode()]


def encode_example(prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids and next-token labels (-100 = no loss) for one example."""
    context = encode_prompt(prompt)
    target = [*answer.encode(), EOS_ID]
    ids = context + target
    labels = [-100] * (len(context) - 1) + target + [-100]
    return ids, labels


def sample_batch(rng: random.Random, task: Callable[[str], str],
                 batch_size: int, excluded: set[str]):
    """A batch of prompts of one random length, right-padded where answers
    differ in length; labels[t] is the target for position t."""
    length = rng.randint(MIN_LEN, MAX_LEN)
    rows = []
    while len(rows) < batch_size:
        prompt = random_prompt(rng, length)
        if prompt not in excluded:
            rows.append(encode_example(prompt, task(prompt)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((batch_size, width), PAD_ID, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(lab)] = torch.tensor(lab)
    return input_ids, labels


# --------------------------------------------------------------------------
# Model, training and evaluation
# --------------------------------------------------------------------------

def build_base_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        do_sample=False, max_new_tokens=EXPECTED_MAX_NEW_TOKENS)
    return model


@dataclass
class TrainSpec:
    steps: int
    lr: float
    batch_size: int = 128
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = SEED


def lr_factor(step: int, spec: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak rate."""
    if step < spec.warmup:
        return (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(model: torch.nn.Module, task: Callable[[str], str], spec: TrainSpec,
          excluded: set[str], name: str) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay,
                            betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, spec))
    rng = random.Random(spec.seed)
    model.train()
    start, running = time.time(), None
    for step in range(spec.steps):
        input_ids, labels = sample_batch(rng, task, spec.batch_size, excluded)
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % 100 == 0 or step + 1 == spec.steps:
            print(f"  [{name}] step {step + 1:5d}/{spec.steps}  loss {running:.4f}"
                  f"  {time.time() - start:6.1f}s", flush=True)
    model.eval()


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, prompts: list[str],
                   max_new_tokens: int) -> list[str]:
    """Greedy answers via ``generate``; equal-length prompts share a batch,
    so no padding (and no attention mask) is ever needed."""
    model.eval()
    answers: dict[str, str] = {}
    by_length: dict[int, list[str]] = {}
    for p in dict.fromkeys(prompts):
        by_length.setdefault(len(p), []).append(p)
    for group in by_length.values():
        input_ids = torch.tensor([encode_prompt(p) for p in group])
        out = model.generate(input_ids=input_ids,
                             attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        for p, row in zip(group, out[:, input_ids.shape[1]:].tolist()):
            answers[p] = decode_answer(row)
    return [answers[p] for p in prompts]


def decode_answer(ids: list[int]) -> str:
    """Bytes up to (excluding) the first eos; specials other than eos dropped."""
    if EOS_ID in ids:
        ids = ids[:ids.index(EOS_ID)]
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def exact_match(model: torch.nn.Module, task: Callable[[str], str],
                prompts: list[str]) -> float:
    got = greedy_answers(model, prompts, EVAL_MAX_NEW_TOKENS)
    return sum(g == task(p) for g, p in zip(got, prompts)) / len(prompts)


# --------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass
class AdapterSpec:
    task: Callable[[str], str]
    lora: dict
    train: TrainSpec
    notes: str = ""
    extra: dict = field(default_factory=dict)


ADAPTERS: dict[str, AdapterSpec] = {
    "upper": AdapterSpec(
        task=upper_task,
        lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
        train=TrainSpec(steps=300, lr=3e-3, seed=SEED + 1),
    ),
    "reverse": AdapterSpec(
        task=reverse_task,
        lora=dict(r=16, lora_alpha=32, target_modules="all-linear"),
        train=TrainSpec(steps=900, lr=3e-3, seed=SEED + 2),
    ),
    "spell": AdapterSpec(
        task=spell_task,
        lora=dict(r=4, lora_alpha=8, target_modules=ATTN + MLP,
                  rank_pattern={"mlp.down_proj": 16, "layers.0.self_attn.q_proj": 8},
                  alpha_pattern={"self_attn.o_proj": 16}),
        train=TrainSpec(steps=900, lr=3e-3, seed=SEED + 3),
    ),
    "rot13": AdapterSpec(
        task=rot13_task,
        lora=dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["o_proj"] + MLP),
        train=TrainSpec(steps=400, lr=3e-3, seed=SEED + 4),
    ),
}

BASE_TRAIN = TrainSpec(steps=1500, lr=3e-3, weight_decay=0.01, seed=SEED)


def load_base(base_dir: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    # Recorded by PEFT as base_model_name_or_path in adapter_config.json.
    model.config.name_or_path = BASE_MODEL_NAME
    return model


def train_adapter(base_dir: Path, out_dir: Path, name: str, spec: AdapterSpec,
                  train_spec: TrainSpec, excluded: set[str]):
    model = load_base(base_dir)
    torch.manual_seed(train_spec.seed)  # LoRA A init
    config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none",
                        **spec.lora)
    peft_model = get_peft_model(model, config)
    peft_model.print_trainable_parameters()
    train(peft_model, spec.task, train_spec, excluded, name)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    fix_adapter_config(out_dir / "adapter_config.json")
    return peft_model


def fix_adapter_config(path: Path) -> None:
    """Make sure the adapter points at the logical base name, not a path."""
    config = json.loads(path.read_text())
    if config.get("base_model_name_or_path") != BASE_MODEL_NAME or config.get("revision"):
        config["base_model_name_or_path"] = BASE_MODEL_NAME
        config["revision"] = None
        write_json(path, config)


# --------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------

def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def scaled(spec: TrainSpec, quick: bool) -> TrainSpec:
    if not quick:
        return spec
    return TrainSpec(steps=5, lr=spec.lr, batch_size=16, warmup=2,
                     weight_decay=spec.weight_decay, seed=spec.seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "demo")
    parser.add_argument("--quick", action="store_true",
                        help="a few tiny steps only (smoke test, no quality)")
    args = parser.parse_args()

    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    out: Path = args.out
    base_dir, adapters_dir = out / "base", out / "adapters"
    for d in (base_dir, adapters_dir):
        if d.exists():
            shutil.rmtree(d)
    base_dir.mkdir(parents=True)
    adapters_dir.mkdir(parents=True)

    heldout = heldout_prompts(NUM_HELDOUT if not args.quick else 20)
    excluded = set(heldout) | set(DEMO_PROMPTS)
    accuracy: dict[str, float] = {}
    expected: dict[str, list[str]] = {}

    print("== base (copy)", flush=True)
    model = build_base_model()
    print(f"  {sum(p.numel() for p in model.parameters()):,} parameters")
    train(model, copy_task, scaled(BASE_TRAIN, args.quick), excluded, "base")
    model.save_pretrained(str(base_dir), safe_serialization=True)
    save_tokenizer(build_tokenizer(), base_dir)
    check_tokenizer(base_dir)
    accuracy["__base__"] = exact_match(model, copy_task, heldout)
    expected["__base__"] = greedy_answers(model, DEMO_PROMPTS, EXPECTED_MAX_NEW_TOKENS)
    print(f"  held-out exact match: {accuracy['__base__']:.3f}", flush=True)

    for name, spec in ADAPTERS.items():
        print(f"== adapter {name}", flush=True)
        peft_model = train_adapter(base_dir, adapters_dir / name, name, spec,
                                   scaled(spec.train, args.quick), excluded)
        accuracy[name] = exact_match(peft_model, spec.task, heldout)
        expected[name] = greedy_answers(peft_model, DEMO_PROMPTS,
                                        EXPECTED_MAX_NEW_TOKENS)
        print(f"  held-out exact match: {accuracy[name]:.3f}", flush=True)

    write_json(out / "expected.json", {
        "format": PROMPT_FORMAT,
        "max_new_tokens": EXPECTED_MAX_NEW_TOKENS,
        "prompts": DEMO_PROMPTS,
        "outputs": expected,
    })
    write_json(out / "accuracy.json", {
        "heldout_prompts": len(heldout),
        "exact_match": accuracy,
    })

    print(f"\nHeld-out greedy exact-match accuracy ({len(heldout)} prompts):")
    for name, acc in accuracy.items():
        print(f"  {name:10s} {acc * 100:6.2f}%")
    print(f"Total time: {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
