"""A row inside the engine: the request that enters, the sequence it becomes, the result that leaves.

Owns request state, which lives as long as a row's attempt (docs/design.md,
The data path of one ``mlora batch-run`` job): a sequence's tokens, how many of
them have K/V computed, its KV blocks and its adapter lease, and the rules that
refuse a request at the door or finish a row (end-of-sequence token, stop
string, ``max_new_tokens``, the model's context). Must not schedule or touch
devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mlora.batch.engine.sampling import SamplingParams
from mlora.batch.model.prefix import Execution


@dataclass
class Request:
    row: int  # global input row position
    id: str
    prompt_ids: list[int]
    adapter: str | None  # None = base model on purpose
    max_new_tokens: int


@dataclass
class Result:
    row: int
    id: str
    adapter: str | None
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    num_prompt_tokens: int
    error_code: str | None = None
    error_message: str | None = None
    text: str | None = None  # the completion, cut before a stop string (None: decode token_ids)


def error_result(req: Request, code: str, message: str) -> Result:
    """``req`` as an error row: no tokens, ``code`` and ``message``."""
    return Result(req.row, req.id, req.adapter, [], "error", len(req.prompt_ids), code, message)


@dataclass(eq=False)  # identity: the scheduler looks sequences up in its lists on every iteration
class Sequence:
    req: Request
    key: int  # the row's random stream (sampling.row_key)
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    admitted: int = 0  # admission counter (preemption picks the latest)
    arrival: int = 0  # admissions before the request arrived (kept across preemption)
    lease: str | None = None  # the bank lease on its adapter while running (docs/design.md, Lease)
    is_running: bool = False  # in the scheduler's running list (kept in step with it: O(1) membership)
    text: str | None = None
    # what computes it: the adapter it runs with (None: the base; an aLoRA row whose prompt lacks the
    # invocation may run on the base) and, for an aLoRA row, its first adapted position
    adapter: str | None = None
    active_from: int = 0
    # the prefix cache (docs/batch.md, Prefix cache): the row's execution identity, the keys of its
    # full blocks known so far, its leading blocks that are in the cache's index (matched or published,
    # read-only), and its first-block group (admission keeps a group's rows together)
    execution: Execution | None = None
    keys: list[str] = field(default_factory=list)
    published: int = 0
    group: int = 0

    def adapter_at(self, position: int) -> str | None:
        """The adapter that computes ``position`` (None: the base)."""
        return self.adapter if position >= self.active_from else None

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.req.prompt_ids):]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt_ids)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed

    def result(self, reason: str) -> Result:
        """The finished row."""
        r = self.req
        return Result(r.row, r.id, r.adapter, self.generated, reason, len(r.prompt_ids), text=self.text)


@dataclass(frozen=True)
class Decoding:
    """How logits become tokens and when a row stops: the job's sampling parameters, its
    stop strings, and the detokenizer that finds them in a row's completion."""

    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple[str, ...] = ()
    detokenize: Callable[[list[int]], str] | None = None

    def __post_init__(self):
        if self.stop_strings and self.detokenize is None:
            raise ValueError("stop strings need a detokenizer")

    def append(self, seq: Sequence, tok: int, eos: set[int], max_context: int) -> str | None:
        """Add a sampled token to ``seq``; the finish reason if the row is done."""
        if tok in eos:
            return "stop"  # the EOS token itself is not part of the completion
        seq.tokens.append(tok)
        if self.stop_strings:
            text = self.detokenize(seq.generated)
            cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = text[:cut]
                return "stop"
        if seq.num_generated >= seq.req.max_new_tokens or len(seq.tokens) >= max_context:
            return "length"
        return None


def refusal(req: Request, pinned: dict, *, max_context: int, block_size: int, max_row_blocks: int
            ) -> tuple[str, str] | None:
    """(code, message) when ``req`` can never run: an empty or too long prompt, more KV blocks
    than one row may hold, an adapter that is unknown or not servable, ``max_new_tokens < 1``."""
    n = len(req.prompt_ids)
    if n == 0:
        return "E_PROMPT_EMPTY", "the prompt has no tokens; give a non-empty prompt"
    if n >= max_context:
        return ("E_PROMPT_TOO_LONG", f"the prompt has {n} tokens; the model's context is {max_context} "
                "(shorten the prompt)")
    need = -(-min(n + max(req.max_new_tokens, 1), max_context) // block_size)
    if need > max_row_blocks:
        return ("E_PROMPT_TOO_LONG", f"prompt + max_new_tokens need {need} KV blocks, the cache holds "
                f"{max_row_blocks} (shorten the prompt, lower --max-new-tokens or give the cache more memory)")
    if req.adapter is not None:
        p = pinned.get(req.adapter)
        unknown = (f"adapter {req.adapter!r} was not pinned for this job: it is not in the catalog, or no adapter "
                   "source (--adapters / --catalog) was given")
        if p is None:
            return "E_ADAPTER_UNKNOWN", unknown
        if not p.ok:
            return p.error_code or "E_ADAPTER_UNKNOWN", p.error_message or unknown
    if req.max_new_tokens < 1:
        return "E_MAX_NEW_TOKENS", f"max_new_tokens is {req.max_new_tokens}; it must be >= 1"
    return None
