"""One frozen engine configuration, made of sub-configs, passed down as plain values."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpserve.engine.draft_policy import DEFAULT_DRAFT_COST
from mtpserve.engine.speculative import MAX_NUM_DRAFTS as MAX_DRAFT_TOKENS


@dataclass(frozen=True)
class CacheConfig:
    """Pool sizes. num_blocks is per paged pool (the main model's and the MTP head's are equal).

    num_blocks None = enough for every resident request at full context, capped so the main
    model's KV pool takes at most kv_pool_gib (see `resolve_num_blocks`).
    """
    num_blocks: int | None = None
    max_resident_requests: int = 64     # fixed-state bank rows (one per resident request)
    kv_pool_gib: float = 2.0

    def validate(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is scratch), got {self.num_blocks}")
        if self.kv_pool_gib <= 0:
            raise ValueError(f"kv_pool_gib must be > 0, got {self.kv_pool_gib}")
        if self.max_resident_requests < 1:
            raise ValueError(f"max_resident_requests must be >= 1, got {self.max_resident_requests}")


def resolve_num_blocks(cache: CacheConfig, context_length: int, block_size: int, bytes_per_block: int) -> int:
    """The block count to allocate: the configured one, or the default described in CacheConfig."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    full_context = cache.max_resident_requests * -(-context_length // block_size) + 1
    budget = int(cache.kv_pool_gib * 2**30) // max(1, bytes_per_block)
    return max(2, min(full_context, budget))


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget and a batch limit shared by prefill chunks, decodes and drafts."""
    max_tokens_per_step: int = 512
    max_requests_per_step: int = 64

    def validate(self) -> None:
        if self.max_tokens_per_step < 1 + MAX_DRAFT_TOKENS:
            raise ValueError(f"max_tokens_per_step must be >= {1 + MAX_DRAFT_TOKENS}, "
                             f"got {self.max_tokens_per_step}")
        if self.max_requests_per_step < 1:
            raise ValueError(f"max_requests_per_step must be >= 1, got {self.max_requests_per_step}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: draft tokens per request per step.

    num_draft_tokens: a fixed K for every request (0 = MTP off).
    adaptive: ``--draft-tokens auto``: each request's K is chosen from its measured acceptance
    and the measured step cost (``draft_policy.AdaptiveDraftPolicy``), up to the model's
    capture capacity; ``draft_cost`` is the guess it starts from (a draft level's cost in plain
    decode steps). num_draft_tokens is then ignored.
    synthetic_acceptance: benchmarking only, for models whose MTP head is untrained: the verifier
    accepts each draft with this probability instead of comparing it with the target (greedy
    requests). The output is then NOT the model's; every report labels such runs synthetic.
    """
    num_draft_tokens: int = 0
    adaptive: bool = False
    draft_cost: float = DEFAULT_DRAFT_COST
    synthetic_acceptance: float | None = None

    @staticmethod
    def parse(draft_tokens: str | int | None, **kwargs) -> SpecConfig:
        """From a CLI / config value: an integer K, or "auto" (None means "auto" too)."""
        if draft_tokens is None or str(draft_tokens).strip().lower() == "auto":
            return SpecConfig(adaptive=True, **kwargs)
        try:
            return SpecConfig(num_draft_tokens=int(draft_tokens), **kwargs)
        except ValueError:
            raise ValueError(f"draft tokens must be an integer in [0, {MAX_DRAFT_TOKENS}] or 'auto', "
                             f"got {draft_tokens!r}") from None

    def validate(self) -> None:
        if not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        if self.draft_cost <= 0:
            raise ValueError(f"draft cost must be > 0, got {self.draft_cost}")
        a = self.synthetic_acceptance
        if a is not None and not 0.0 <= a <= 1.0:
            raise ValueError(f"synthetic acceptance must be in [0, 1], got {a}")

    @property
    def label(self) -> str:
        """"auto" or the fixed K, as the CLI spells it."""
        return "auto" if self.adaptive else str(self.num_draft_tokens)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"                  # "cpu" or "cuda"
    num_threads: int = 0                 # ORT intra-op threads; 0 = ORT's default
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    fused_replay: bool = True            # CUDA: the commit's recurrent replay as one CuPy kernel
    warm_up: bool = True                 # CUDA: run every decode batch size once at start (see Engine)
    max_model_len: int | None = None     # longest prompt + output a request may reach; None = the model's context

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a new one), got {self.max_model_len}")
        self.cache.validate()
        self.scheduler.validate()
        self.spec.validate()
