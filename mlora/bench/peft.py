"""The transformers + PEFT baseline of ``mlora bench batch``: the same job through the obvious alternative.

Runs the same synthetic job as :mod:`mlora.bench.batch` (same prompts, same
adapter assignment, ``max_new_tokens`` per row with EOS ignored) through
Hugging Face transformers and PEFT's mixed-adapter batch inference:
``model.generate(..., adapter_names=[...])`` with one adapter name per row
(``"__base__"`` for base rows), greedy, left-padded batches of ``batch_size``
rows in input order. The model has the preset's shape and random weights made
on the device; the ``n`` adapters are random rank-``rank`` LoRA on all seven
projections (``lora_B`` non-zero so every adapter changes the output).

Reported: generated tokens per second over the whole job (wall clock, after
the model and its adapters are built: ``setup_s``, without the time of
batches that ran out of memory: ``out_of_memory_s``), and a progress call after every batch and, inside a
batch, every ``PROGRESS_EVERY_S`` seconds of generation (tokens of the
finished batches plus decode steps so far x rows of the running batch): one
``generate`` call can outlast a time limit (64 adapters, a 128-row batch),
and a stopped run still leaves its rate. Batch size: the caller's
(an out-of-memory batch raises), or 0 for the largest that fits: ``AUTO_START``
rows, halved after each out-of-memory batch, the size that worked kept for the
rest of the job.
"""

from __future__ import annotations

import time

import torch

from mlora.bench.batch import PRESETS, BatchBenchOptions, _requests, preset_config

AUTO_START = 256  # --batch-size 0: the first batch size tried
PROGRESS_EVERY_S = 15.0  # progress inside a generate() call at most this often
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(preset: str, dtype: torch.dtype, device, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    p = PRESETS[preset]
    cfg = LlamaConfig(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
                      num_hidden_layers=p["num_layers"], num_attention_heads=p["num_heads"],
                      num_key_value_heads=p["num_kv_heads"], head_dim=p["head_dim"], rope_theta=p["rope_theta"],
                      max_position_embeddings=p["max_position_embeddings"], tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def add_adapters(model, n: int, rank: int, seed: int = 0):
    """``n`` random LoRA adapters named ``bench-0 .. bench-{n-1}`` (PeftModel), or the model itself for n = 0."""
    if n == 0:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    peft = get_peft_model(model, config, adapter_name="bench-0")
    for i in range(1, n):
        peft.add_adapter(f"bench-{i}", config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:  # PEFT initialises B to zero: make every adapter matter
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    return peft.eval()


class _StepProgress:
    """A transformers stopping criterion that never stops generation: it is called once per
    generated token of the batch and calls ``report(tokens_in_batch)`` at most every
    ``every`` seconds (``tokens_in_batch`` = new positions so far x rows; no device sync:
    the sequence length is a host-side shape)."""

    def __init__(self, width: int, report, every: float = PROGRESS_EVERY_S):
        self.width, self.report, self.every = width, report, every
        self.last = time.perf_counter()

    def __call__(self, input_ids, scores, **kwargs):
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.report((input_ids.shape[1] - self.width) * input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_peft_baseline(o: BatchBenchOptions, n_adapters: int, batch_size: int, progress=None,
                      progress_every: float = PROGRESS_EVERY_S) -> dict:
    """Generated tokens/s of the synthetic job through transformers + PEFT. ``progress(done
    rows, total rows, tokens, seconds, setup seconds, running rows)`` is called after each
    batch (running 0) and inside a batch every ``progress_every`` seconds."""
    dev = torch.device(o.device)
    dtype = getattr(torch, o.dtype)
    config = preset_config(o.preset, o.dtype)
    t_setup = time.perf_counter()
    model = add_adapters(hf_model(o.preset, dtype, dev, o.seed), n_adapters, o.rank, o.seed)
    setup = time.perf_counter() - t_setup
    reqs = _requests(o, config, n_adapters, o.rows, o.max_new_tokens, o.seed)
    generated, lost = 0, 0.0  # lost: seconds of batches that ran out of memory (not the baseline's time)
    auto = batch_size == 0
    if auto:  # the largest batch that fits: start high, halve on out-of-memory, keep what worked
        batch_size = min(len(reqs), AUTO_START)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if progress:  # the model and adapters are built (minutes for 64 adapters on the 8B shape)
        progress(0, len(reqs), 0, 0.0, setup, 0)
    start = 0
    while start < len(reqs):
        batch = reqs[start : start + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        kwargs = dict(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=o.max_new_tokens,
                      do_sample=False, pad_token_id=0)  # no EOS id: every row runs to max_new_tokens
        if n_adapters:
            kwargs["adapter_names"] = [r.adapter or "__base__" for r in batch]
        if progress:
            from transformers import StoppingCriteriaList

            def inside(tokens, start=start, n=len(batch)):
                progress(start, len(reqs), generated + tokens, time.perf_counter() - t0 - lost, setup, n)

            kwargs["stopping_criteria"] = StoppingCriteriaList([_StepProgress(width, inside, progress_every)])
        t_batch = time.perf_counter()
        try:
            with torch.no_grad():
                out = model.generate(**kwargs)
        except torch.OutOfMemoryError:
            if not auto or batch_size == 1:
                raise
            del kwargs, ids, mask
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            lost += time.perf_counter() - t_batch
            batch_size //= 2
            continue
        generated += (out.shape[1] - width) * len(batch)
        start += len(batch)
        if progress:  # with the tokens so far: a run stopped by a time limit still tells its rate
            progress(start, len(reqs), generated, time.perf_counter() - t0 - lost, setup, 0)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0 - lost
    return dict(adapters=n_adapters, rows=len(reqs), batch_size=batch_size, generated_tokens=generated, wall_s=wall,
                tokens_per_s=generated / wall, setup_s=setup, out_of_memory_s=lost)
