"""Build the embedded mlora demo workspace (``examples/demo/``) from scratch.

Everything is trained locally on CPU, deterministically, in under ten minutes
on two cores; no model hub access is needed.

Toy task
--------
Every example is one byte-level sequence::

    <|bos|> PROMPT "=" ANSWER <|eos|>

PROMPT is a random string of 3-12 characters: each one a lowercase letter,
digit or space with probability 70/15/15 %, spaces never leading, trailing or
doubled. The loss is taken only on ANSWER and the closing ``<|eos|>``. What
ANSWER is depends on who answers:

============  ======================================  ======================
model         ANSWER                                  "abc 123" ->
============  ======================================  ======================
base          the prompt, copied                      ``abc 123``
``upper``     ``prompt.upper()``                      ``ABC 123``
``reverse``   the prompt reversed                     ``321 cba``
``spell``     digits spelled out (rule below)         ``abc one two three``
``rot13``     letters rotated by 13, rest unchanged   ``nop 123``
============  ======================================  ======================

``spell`` rule: every digit is replaced by its English word ("zero" ..
"nine") and a single space is put between a digit word and any neighbouring
character that is not already a space: "ab 42" -> "ab four two",
"a4b" -> "a four b". Letters and the prompt's own spaces are kept.

Architecture
------------
The base is a tiny ``LlamaForCausalLM``: 4 layers, hidden size 128, 4 query
heads sharing 2 key/value heads (GQA), head dim 32, SwiGLU MLP of width 256,
RoPE, 128 positions, untied embeddings: 657,280 parameters. Its 259-token
vocabulary is one token per byte (token id == byte value; a GPT-2 style
byte-level BPE without merges) followed by ``<|bos|>`` = 256, ``<|eos|>`` =
257 and ``<|pad|>`` = 258. It is trained from scratch to copy; a fifth of its
training prompts also contain uppercase letters, so that the base has trained
output embeddings for the bytes ``upper`` must produce (a LoRA cannot touch
``lm_head``).

Adapters
--------
Four PEFT LoRA adapters are trained on top of the frozen base, each with its
own rank / target layout, so that an inference engine has to handle them all:

* ``upper``   r=8, alpha=16 on q_proj, v_proj, down_proj
* ``reverse`` r=16, alpha=32 on "all-linear" (every projection of every layer)
* ``spell``   r=8, alpha=16 on all attention and MLP projections, with a
  ``rank_pattern`` and an ``alpha_pattern`` overriding some modules
* ``rot13``   r=8, alpha=8, ``use_rslora`` (scale alpha/sqrt(r)), on o_proj
  and the MLP projections

Each ``adapter_config.json`` names ``mlora-demo/base`` as its base model.

Procedure
---------
Two single-threaded worker processes do the work: they first train the base
data-parallel (same batch drawn on both, half each, gradients summed through
torch.distributed/gloo), then the four adapters, two at a time. The held-out
prompts (and the demo prompts) are never trained on.

Outputs (under ``--out``, default ``examples/demo``)::

    base/               config.json, generation_config.json, model.safetensors,
                        tokenizer.json, tokenizer_config.json,
                        special_tokens_map.json
    adapters/<name>/    adapter_config.json, adapter_model.safetensors
    expected.json       greedy answers of every model for fixed demo prompts
    README.md           description, configs, accuracies, sample outputs

Usage::

    python examples/train_demo.py [--out examples/demo] [--quick]

``--quick`` runs a handful of tiny steps only, to smoke-test the script (in
under a minute); unless ``--out`` is given it writes to
``$TMPDIR/mlora-demo-quick``, never over the real workspace.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.utils import logging as hf_logging

SEED = 1234
# Two worker processes with one thread each (the machine budget is 2 cores):
# the base is trained data-parallel over both, then the adapters two at a
# time. Single-threaded processes are faster here than one process with two
# threads, keep working when something else runs on the machine, and make
# every result independent of scheduling.
WORKERS = 2
THREADS = 1
BASE_MODEL_NAME = "mlora-demo/base"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 259
MAX_POSITIONS = 128
SEP = "="

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
MIN_LEN, MAX_LEN = 3, 12
P_LETTER, P_DIGIT, P_SPACE = 0.70, 0.15, 0.15

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


def setup_process(threads: int) -> None:
    """Fixed thread count (results depend on it) and quieter libraries."""
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


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
    assert tok(framed, add_special_tokens=False).input_ids == [BOS_ID, *b"ab 42="]


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

def random_prompt(rng: random.Random, length: int | None = None,
                  letters: str = LETTERS) -> str:
    """3-12 characters: letters, digits and single inner spaces.

    Each character is a letter, digit or space with probability 70/15/15 %
    (spaces never leading, trailing or doubled: then letter/digit only).
    """
    if length is None:
        length = rng.randint(MIN_LEN, MAX_LEN)
    chars: list[str] = []
    for i in range(length):
        space_ok = 0 < i < length - 1 and chars[-1] != " "
        pools = [letters, DIGITS, " "]
        weights = [P_LETTER, P_DIGIT, P_SPACE if space_ok else 0.0]
        pool = rng.choices(pools, weights)[0]
        chars.append(rng.choice(pool))
    return "".join(chars)


def training_prompt(rng: random.Random, length: int, spec: "TrainSpec") -> str:
    """A prompt as in ``random_prompt``, except that a share ``spec.mixed_case``
    of them also contains uppercase letters. Used for the base only, so that
    it can copy, and has trained output embeddings for, the bytes ``upper``
    must produce (a LoRA adapter cannot change ``lm_head``)."""
    if rng.random() < spec.mixed_case:
        return random_prompt(rng, length, LETTERS + LETTERS.upper())
    return random_prompt(rng, length)


def heldout_prompts(n: int) -> list[str]:
    """Fixed evaluation prompts from the task distribution; training skips
    them (and the demo prompts)."""
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
    """Token ids and per-position targets (-100 = no loss) for one example:
    position t is trained to predict ids[t + 1], for answer bytes and eos."""
    context = encode_prompt(prompt)
    target = [*answer.encode(), EOS_ID]
    ids = context + target
    labels = [-100] * (len(context) - 1) + target + [-100]
    return ids, labels


def pad(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a list of (ids, labels) to a pair of [batch, width] tensors."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(lab)] = torch.tensor(lab)
    return input_ids, labels


def sample_batch(rng: random.Random, task: Callable[[str], str],
                 spec: "TrainSpec", excluded: set[str]):
    """One batch of prompts of a single random length, split into
    ``micro_batches`` chunks of similar sequence length to save padding."""
    length = rng.randint(MIN_LEN, MAX_LEN)
    rows = []
    while len(rows) < spec.batch_size:
        prompt = training_prompt(rng, length, spec)
        if prompt not in excluded:
            rows.append(encode_example(prompt, task(prompt)))
    rows.sort(key=lambda row: len(row[0]))
    size = math.ceil(spec.batch_size / spec.micro_batches)
    return [pad(rows[i:i + size]) for i in range(0, spec.batch_size, size)]


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


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    lr: float
    seed: int
    batch_size: int = 64
    micro_batches: int = 1
    warmup: int = 50
    weight_decay: float = 0.0
    mixed_case: float = 0.0

    def quick(self) -> "TrainSpec":
        """The --quick smoke-test variant: a few tiny steps."""
        return replace(self, steps=6, batch_size=8, warmup=2)


def lr_factor(step: int, spec: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak rate."""
    if step < spec.warmup:
        return (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(model: torch.nn.Module, task: Callable[[str], str], spec: TrainSpec,
          excluded: set[str], name: str, rank: int = 0, world: int = 1) -> None:
    """AdamW on the trainable parameters; token-level cross-entropy on the
    answer and eos only (mean over all such tokens of the batch).

    With ``world`` > 1 (a torch.distributed group), every rank draws the same
    batch, runs its share of the micro-batches and the gradients are summed.
    """
    assert spec.micro_batches >= world, "every rank needs a micro-batch"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.98),
                            weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, spec))
    rng = random.Random(spec.seed)
    model.train()
    start, running = time.time(), None
    for step in range(spec.steps):
        chunks = sample_batch(rng, task, spec, excluded)
        n_targets = sum(int((labels != -100).sum()) for _, labels in chunks)
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for input_ids, labels in chunks[rank::world]:
            logits = model(input_ids=input_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                   ignore_index=-100, reduction="sum") / n_targets
            loss.backward()
            total += loss.item()
        if world > 1:
            total = all_reduce_grads(params, total)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running = total if running is None else 0.95 * running + 0.05 * total
        if rank == 0 and ((step + 1) % 100 == 0 or step + 1 == spec.steps):
            print(f"  [{name}] step {step + 1:4d}/{spec.steps}  loss {running:.4f}"
                  f"  {time.time() - start:5.0f}s", flush=True)
    model.eval()


def all_reduce_grads(params: list[torch.Tensor], loss: float) -> float:
    """Sum gradients (and the loss, carried along) over all ranks."""
    flat = torch.cat([p.grad.flatten() for p in params] + [torch.tensor([loss])])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat[-1].item()


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, prompts: list[str],
                   max_new_tokens: int) -> list[str]:
    """Greedy answers via ``generate``. Prompts of equal length share a batch,
    so no padding is ever needed."""
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
    """The bytes before the first eos (all of them if there is none)."""
    if EOS_ID in ids:
        ids = ids[:ids.index(EOS_ID)]
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def demo_answers(model: torch.nn.Module) -> list[str]:
    """Reference answers for expected.json: one prompt at a time."""
    return [greedy_answers(model, [p], EXPECTED_MAX_NEW_TOKENS)[0] for p in DEMO_PROMPTS]


def exact_match(model: torch.nn.Module, task: Callable[[str], str],
                prompts: list[str]) -> float:
    got = greedy_answers(model, prompts, EVAL_MAX_NEW_TOKENS)
    return sum(g == task(p) for g, p in zip(got, prompts)) / len(prompts)


# --------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    task: Callable[[str], str]
    lora: dict
    train: TrainSpec


BASE_TRAIN = TrainSpec(steps=900, lr=3e-3, seed=SEED, batch_size=128,
                       micro_batches=WORKERS, weight_decay=0.01, mixed_case=0.2)

# Listed slowest first: they are handed to the worker processes in this order.
ADAPTERS: dict[str, AdapterSpec] = {
    "spell": AdapterSpec(
        task=spell_task,
        # Pattern keys are PEFT regexes matched against the end of module
        # names (see README_TEMPLATE, which spells out their effect).
        lora=dict(r=8, lora_alpha=16, target_modules=ATTN + MLP,
                  rank_pattern={"mlp.down_proj": 32, "layers.0.self_attn.q_proj": 16},
                  alpha_pattern={"self_attn.o_proj": 32}),
        train=TrainSpec(steps=400, lr=8e-3, seed=SEED + 3, batch_size=128,
                        micro_batches=2),
    ),
    "reverse": AdapterSpec(
        task=reverse_task,
        lora=dict(r=16, lora_alpha=32, target_modules="all-linear"),
        train=TrainSpec(steps=700, lr=5e-3, seed=SEED + 2),
    ),
    "rot13": AdapterSpec(
        task=rot13_task,
        lora=dict(r=8, lora_alpha=8, use_rslora=True,
                  target_modules=["o_proj"] + MLP),
        train=TrainSpec(steps=400, lr=5e-3, seed=SEED + 4),
    ),
    "upper": AdapterSpec(
        task=upper_task,
        lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
        train=TrainSpec(steps=400, lr=5e-3, seed=SEED + 1),
    ),
}
OUTPUT_ORDER = ["upper", "reverse", "spell", "rot13"]


def load_base(base_dir: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    # PEFT records this as base_model_name_or_path in adapter_config.json.
    model.config.name_or_path = BASE_MODEL_NAME
    return model


def train_base_rank(rank: int, init_file: Path, base_dir: Path, quick: bool,
                    excluded: set[str]) -> None:
    """One rank of the data-parallel base training; rank 0 saves the model."""
    setup_process(THREADS)
    dist.init_process_group("gloo", init_method=init_file.resolve().as_uri(),
                            rank=rank, world_size=WORKERS)
    try:
        model = build_base_model()
        spec = BASE_TRAIN.quick() if quick else BASE_TRAIN
        train(model, copy_task, spec, excluded, "base", rank, WORKERS)
        if rank == 0:
            model.save_pretrained(str(base_dir), safe_serialization=True)
    finally:
        dist.destroy_process_group()


def train_base(base_dir: Path, quick: bool, excluded: set[str]) -> None:
    ctx = multiprocessing.get_context("spawn")
    init_file = base_dir / ".dist_init"
    procs = [ctx.Process(target=train_base_rank,
                         args=(rank, init_file, base_dir, quick, excluded))
             for rank in range(WORKERS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    init_file.unlink(missing_ok=True)
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError("base training failed")


def normalise_adapter_dir(out_dir: Path) -> None:
    """Make the saved adapter reproducible and path-independent.

    * ``base_model_name_or_path`` must be the logical base name (it is, since
      ``load_base`` sets it; this is a safety net) and ``revision`` null;
    * PEFT stores ``target_modules`` from a set, in hash order: sort it;
    * PEFT's generated model card (README.md) names the local base path and
      carries no information: drop it.
    """
    path = out_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = BASE_MODEL_NAME
    config["revision"] = None
    if isinstance(config["target_modules"], list):
        config["target_modules"] = sorted(config["target_modules"])
    write_json(path, config)
    (out_dir / "README.md").unlink(missing_ok=True)


@dataclass
class AdapterResult:
    name: str
    accuracy: float
    demo_answers: list[str]
    seconds: float


def build_adapter(name: str, base_dir: Path, out_dir: Path, quick: bool,
                  heldout: list[str]) -> AdapterResult:
    """Train one adapter on the frozen base, save it, evaluate it."""
    start = time.time()
    spec = ADAPTERS[name]
    train_spec = spec.train.quick() if quick else spec.train
    torch.manual_seed(train_spec.seed)  # initialisation of the LoRA A matrices
    config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **spec.lora)
    model = get_peft_model(load_base(base_dir), config)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"== adapter {name}: {n_params:,} trainable parameters", flush=True)
    train(model, spec.task, train_spec, set(heldout) | set(DEMO_PROMPTS), name)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    normalise_adapter_dir(out_dir)
    accuracy = exact_match(model, spec.task, heldout)
    print(f"  [{name}] held-out exact match {accuracy:.3f}", flush=True)
    demo = demo_answers(model)
    return AdapterResult(name, accuracy, demo, time.time() - start)


def build_adapters(base_dir: Path, adapters_dir: Path, quick: bool,
                   heldout: list[str]) -> dict[str, AdapterResult]:
    """Train all adapters, ``WORKERS`` at a time."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=WORKERS, mp_context=ctx,
                             initializer=setup_process, initargs=(THREADS,)) as pool:
        futures = [pool.submit(build_adapter, name, base_dir, adapters_dir / name,
                               quick, heldout) for name in ADAPTERS]
        results = [f.result() for f in futures]
    return {r.name: r for r in results}


# --------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------

def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def describe_lora(lora: dict) -> str:
    targets = lora["target_modules"]
    parts = [f"r={lora['r']}", f"lora_alpha={lora['lora_alpha']}",
             "targets " + (f'"{targets}"' if isinstance(targets, str) else ", ".join(targets))]
    if lora.get("use_rslora"):
        parts.append("use_rslora (scale alpha/sqrt(r))")
    for key in ("rank_pattern", "alpha_pattern"):
        if lora.get(key):
            parts.append(f"{key} `{json.dumps(lora[key])}`")
    return "; ".join(parts)


def model_table(accuracy: dict[str, float], n_params: int) -> str:
    rows = ["| model | answer | LoRA config | held-out exact match |",
            "| --- | --- | --- | --- |",
            f"| base | {TASK_DESCRIPTIONS['__base__']} | none ({n_params:,} parameters) "
            f"| {accuracy['__base__']:.1%} |"]
    for name in OUTPUT_ORDER:
        rows.append(f"| `{name}` | {TASK_DESCRIPTIONS[name]} | "
                    f"{describe_lora(ADAPTERS[name].lora)} | {accuracy[name]:.1%} |")
    return "\n".join(rows)


def examples_table(expected: dict[str, list[str]], n_prompts: int) -> str:
    """Demo answers; a wrong one is marked and followed by the right one."""
    models = ["__base__"] + OUTPUT_ORDER
    rows = ["| prompt | base | " + " | ".join(OUTPUT_ORDER) + " |",
            "| --- |" + " --- |" * len(models)]
    for i, prompt in enumerate(DEMO_PROMPTS[:n_prompts]):
        cells = []
        for name in models:
            got, want = expected[name][i], task_of(name)(prompt)
            cells.append(f"`{got}`" if got == want else f"`{got}` (wrong: `{want}`)")
        rows.append(f"| `{prompt}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def task_of(name: str) -> Callable[[str], str]:
    return copy_task if name == "__base__" else ADAPTERS[name].task


def write_readme(path: Path, accuracy: dict[str, float], n_heldout: int,
                 expected: dict[str, list[str]], n_params: int) -> None:
    path.write_text(README_TEMPLATE.format(
        models=model_table(accuracy, n_params),
        examples=examples_table(expected, 4),
        n_heldout=n_heldout,
        max_new_tokens=EXPECTED_MAX_NEW_TOKENS,
        base_steps=BASE_TRAIN.steps,
        base_batch=BASE_TRAIN.batch_size,
    ))


TASK_DESCRIPTIONS = {
    "__base__": "the prompt, copied",
    "upper": "`prompt.upper()`",
    "reverse": "the prompt reversed",
    "spell": "digits spelled out as words",
    "rot13": "letters rotated by 13",
}

README_TEMPLATE = """\
# mlora demo workspace

A tiny, fully local Llama-architecture base model plus four LoRA adapters,
small enough to live in the repository and to be served on a CPU. Everything
here is generated by `examples/train_demo.py` (do not edit by hand):

```
python examples/train_demo.py            # full run: 8-9 minutes on 2 CPU cores
python examples/train_demo.py --quick    # smoke test of the script (untrained weights)
```

Training is deterministic (fixed seeds, fixed thread counts), so a rerun with
the same library versions on the same kind of CPU rewrites identical files.

## Layout

```
base/               LlamaForCausalLM, Hugging Face layout: config.json,
                    generation_config.json, model.safetensors (float32),
                    tokenizer.json, tokenizer_config.json, special_tokens_map.json
adapters/<name>/    PEFT LoRA adapter: adapter_config.json,
                    adapter_model.safetensors (float32)
expected.json       greedy reference answers for fixed demo prompts
```

Every `adapter_config.json` has `"base_model_name_or_path": "mlora-demo/base"`
(and `"revision": null`): resolve that name to `base/`. Adapter tensors are
named like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.

## The task

Each sequence is `<|bos|>PROMPT=ANSWER<|eos|>`, one token per byte (token id
= byte value; `<|bos|>` = 256, `<|eos|>` = 257, `<|pad|>` = 258). PROMPT is
3-12 characters, each a lowercase letter, digit or space (70/15/15 %; spaces
never leading, trailing or doubled). The base copies the prompt; each adapter
answers with its own transformation:

{models}

Held-out exact match: greedy decoding of {n_heldout} random prompts that were
never trained on, as printed by the training script.

`spell` replaces each digit by its English word and puts a single space
between a digit word and any neighbour that is not already a space
(`ab 42` -> `ab four two`, `a4b` -> `a four b`). The `rank_pattern` /
`alpha_pattern` keys follow PEFT's rule: a key matches a module whose name ends
with it (regular expression `(.*\\.)?KEY$`), so in `spell` the `down_proj`
of every layer has rank 32 (alpha 16), `layers.0.self_attn.q_proj` rank 16
(alpha 16), every `o_proj` rank 8 with alpha 32, and all other modules rank 8,
alpha 16.

## Base model

`LlamaForCausalLM`: vocabulary 259, hidden size 128, 4 layers, 4 attention
heads sharing 2 key/value heads (grouped-query attention), head dim 32, SwiGLU
MLP of width 256, RoPE (theta 10000), RMSNorm eps 1e-6, 128 positions, untied
input and output embeddings. Trained from scratch for {base_steps} steps of
{base_batch} examples; a fifth of its training prompts also contain uppercase
letters, so that it has trained output embeddings for the bytes `upper`
produces.

The tokenizer is a byte-level BPE whose vocabulary is exactly the 256
byte-level symbols (GPT-2 byte-to-unicode map, no merges, ByteLevel
pre-tokenizer without prefix space or regex split, ByteLevel decoder), plus
the three special tokens. `tokenizer_config.json` names
`PreTrainedTokenizerFast` (loadable by transformers 4 and 5; transformers 5
maps it to its `TokenizersBackend`), so `AutoTokenizer.from_pretrained(base/)`
works; it does not add `<|bos|>` by itself.

## Expected outputs

`expected.json` holds, for each demo prompt, the greedy answer of the base
and of every adapter: input `<|bos|>{{prompt}}=` (no padding, batch of one),
at most {max_new_tokens} new tokens, the answer being the decoded text before
`<|eos|>`. Generated with transformers `generate` on the base and on the
PEFT-wrapped base. The first few:

{examples}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: examples/demo; with "
                             "--quick: a folder under the system temp dir)")
    parser.add_argument("--quick", action="store_true",
                        help="a few tiny steps only (smoke test, no quality)")
    args = parser.parse_args()
    if args.out is None:  # never overwrite the real workspace with a smoke test
        args.out = (Path(tempfile.gettempdir()) / "mlora-demo-quick" if args.quick
                    else Path(__file__).resolve().parent / "demo")

    setup_process(THREADS)
    t0 = time.time()
    out: Path = args.out
    base_dir, adapters_dir = out / "base", out / "adapters"
    for d in (base_dir, adapters_dir):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    heldout = heldout_prompts(NUM_HELDOUT if not args.quick else 20)

    print(f"== base (copy), data-parallel over {WORKERS} processes", flush=True)
    train_base(base_dir, args.quick, set(heldout) | set(DEMO_PROMPTS))
    save_tokenizer(build_tokenizer(), base_dir)
    check_tokenizer(base_dir)
    model = load_base(base_dir)
    n_params = sum(p.numel() for p in model.parameters())
    accuracy = {"__base__": exact_match(model, copy_task, heldout)}
    expected = {"__base__": demo_answers(model)}
    print(f"  [base] {n_params:,} parameters, held-out exact match "
          f"{accuracy['__base__']:.3f}  ({time.time() - t0:.0f}s)", flush=True)

    results = build_adapters(base_dir, adapters_dir, args.quick, heldout)
    for name in OUTPUT_ORDER:
        accuracy[name] = results[name].accuracy
        expected[name] = results[name].demo_answers

    write_json(out / "expected.json", {
        "format": PROMPT_FORMAT,
        "max_new_tokens": EXPECTED_MAX_NEW_TOKENS,
        "prompts": DEMO_PROMPTS,
        "outputs": expected,
    })
    write_readme(out / "README.md", accuracy, len(heldout), expected, n_params)

    print(f"\nHeld-out greedy exact-match accuracy ({len(heldout)} prompts):")
    for name, acc in accuracy.items():
        extra = f"  (adapter built in {results[name].seconds:.0f}s)" if name in results else ""
        print(f"  {name:10s} {acc:7.1%}{extra}")
    print(f"Total time: {time.time() - t0:.0f}s; written to {out}")


if __name__ == "__main__":
    main()
