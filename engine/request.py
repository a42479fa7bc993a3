"""A request's life inside one engine, and the events it streams out.

Token bookkeeping of one request (positions are token indices in `token_ids`):

    token_ids      p0 p1 ... pP-1 | o0 o1 ... on-1          prompt | output
    num_computed   tokens folded into the main model's KV and recurrent state
    num_head       tokens whose MTP-head rows are in the head's KV (<= num_computed); the head
                   row at position p pairs the main model's hidden[p] with token_ids[p + 1], so
                   it can run once token p + 1 is known (the proposer keeps those hidden rows)

A step feeds token_ids[num_computed:] (a prefill chunk, or the one newest token of a decode)
plus this step's drafts. The request is "decoding" when exactly one token is left to feed.
Everything here is host data: the request's device state lives in the pools, the state bank
and the proposer, keyed by request id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from mtpserve.engine.sampler import SamplingParams, make_rng
from mtpserve.engine.speculative import SpecDecodeStats
from mtpserve.engine.tokenizer import IncrementalDetokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"           # EOS, a stop token id or a stop string
    LENGTH = "length"       # max_tokens or the context length
    ABORT = "abort"         # cancelled by the caller


class RequestStatus(enum.Enum):
    WAITING = "waiting"     # holds no pool resources
    RUNNING = "running"     # admitted: owns a state row and KV blocks
    FINISHED = "finished"


@dataclass
class TokenEvent:
    """What a step produced for one request: new token ids, the text they add, and the end."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0      # prompt tokens the prefix cache supplied
    logprobs: list | None = None    # with params.logprobs: per token (id, logprob, [(id, logprob)] top)
    prompt_logprobs: list | None = None   # with params.prompt_logprobs, on the first event: prompt tokens 1.. likewise
    queue_s: float | None = None    # on the first event with tokens, set by the serving loop (actors/engine_loop):
    prefill_s: float | None = None  # seconds from arrival to admission, and from admission to this event


@dataclass(eq=False)                   # one request is one object: queues find and drop it by identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    num_head: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    waiting_since: int = 0          # the scheduler's landed steps when it last started waiting (admission holds)
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    _rng: np.random.Generator | None = field(default=None, repr=False)   # see ``rng``
    stop_token_ids: frozenset[int] = frozenset()   # ids that end it: params.stop_token_ids, and EOS unless ignored
    continues: bool = False         # a later request extends this one (a session): the prefix cache snapshots its prompt
    detokenizer: IncrementalDetokenizer | None = None
    num_emitted_text: int = 0              # characters of output text already streamed out
    num_cached_tokens: int = 0             # prompt tokens taken from the prefix cache at admission
    prompt_logprobs: dict[int, tuple] | None = None   # with params.prompt_logprobs: position -> entry,
                                                      # handed out with the first event, then None
    num_prompt_tokens: int = field(init=False)       # len(prompt_token_ids), which never changes

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def rng(self) -> np.random.Generator:
        """The request's own RNG (``params.seed``), made on first use: a greedy request never
        draws (making one for every request was ~9 us a step at C=16 in session 29's py-spy)."""
        if self._rng is None:
            self._rng = make_rng(self.params.seed)
        return self._rng

    @rng.setter
    def rng(self, rng: np.random.Generator) -> None:
        self._rng = rng

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_to_feed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is RequestStatus.RUNNING and len(self.token_ids) - self.num_computed == 1

    @property
    def max_output_left(self) -> int:
        return self.params.max_tokens - len(self.token_ids) + self.num_prompt_tokens

    def reset_for_recompute(self) -> None:
        """Preempted: all device state is gone; the tokens so far are recomputed as a prefill."""
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.num_head = 0
        self.num_cached_tokens = 0
        self.num_preemptions += 1
