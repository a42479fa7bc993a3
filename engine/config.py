"""One frozen engine configuration, made of sub-configs, passed down as plain values.

Configs nest: a Serve deployment's options hold a worker config, which holds this engine config,
which holds the cache, scheduler and speculative configs. Each setting is defined once, as a
dataclass field with its default and its help (``help=`` metadata); the command line and the
Serve config files reach every leaf by its flat name through ``config_fields`` / ``from_flat``
(leaf names are unique across the tree: ``num_blocks``, ``draft_tokens``, ``num_replicas``, ...).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from mtpserve.engine.bundled import MODEL_DIR
from mtpserve.engine.draft_policy import DEFAULT_DRAFT_COST
from mtpserve.engine.speculative import MAX_NUM_DRAFTS as MAX_DRAFT_TOKENS

# The steps a new request may be held on CUDA so that arrivals share a prompt step
# (``SchedulerConfig.admission_hold_steps``).
CUDA_ADMISSION_HOLD_STEPS = 8


def setting(default, help: str, **kwargs):
    """A config field with its help text (what ``--help`` and the docs show)."""
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(frozen=True)
class CacheConfig:
    """Pool sizes. num_blocks is per paged pool (the main model's and the MTP head's are equal).

    num_blocks None = enough for every resident request at full context, capped so the main
    model's KV pool takes at most kv_pool_gib (see `resolve_num_blocks`).
    """
    num_blocks: int | None = setting(None, "paged KV blocks per pool (default: every resident request at full "
                                           "context, within kv_pool_gib)")
    max_resident_requests: int = setting(64, "fixed-state bank rows: requests resident at once")
    kv_pool_gib: float = setting(2.0, "the most GiB the main model's KV pool may take when num_blocks is unset")
    prefix_cache: bool = setting(True, "reuse cached prefixes: shared KV blocks and recurrent-state snapshots "
                                        "(exact, with MTP too)")
    prefix_snapshot_gib: float = setting(1.0, "prefix cache: the most GiB its recurrent-state snapshots take")
    prefix_host_gib: float = setting(4.0, "prefix cache: host memory for entries the device evicts (0 = none)")
    prefix_snapshots: str = setting("reused", "prefix cache: which prompt boundaries get a recurrent-state snapshot "
                                           "(each ends a prompt chunk there): `reused` (where a prompt's match with "
                                           "an earlier one ends, and every boundary of a session's turn: a prompt "
                                           "seen once costs nothing, a session's next turn hits, a session-less "
                                           "repeat hits the third time) or `all` (every boundary of every "
                                           "prompt: a repeat hits the second time)")
    prefix_host_policy: str = setting("reused", "prefix cache: what the host tier takes when the device evicts it: "
                                                "`reused` (prefixes met at least twice: a prompt seen once costs "
                                                "no copies) or `all`")
    snapshot_interval: int | None = setting(None, "prefix cache: a prompt's state is snapshotted every this many "
                                                  "tokens (a multiple of the block size) and at its last full "
                                                  "block (default: the step's token budget, so a long prompt's "
                                                  "chunks end there anyway)")
    kv_block_size: int | None = setting(None, "paged KV block size in tokens (default: the export's); on CUDA, "
                                              "ORT's flash PagedAttention reads prompts and MTP verifies in "
                                              "place only at multiples of 256 / 128 / 64 tokens for attention "
                                              "head sizes up to 64 / 128 / 256, and gathers each request's KV "
                                              "into dense K and V otherwise; larger blocks make prefix hits "
                                              "coarser")

    def validate(self) -> None:
        if self.prefix_snapshot_gib < 0 or self.prefix_host_gib < 0 or (self.snapshot_interval or 1) < 1:
            raise ValueError(f"prefix_snapshot_gib must be >= 0 and snapshot_interval >= 1, got "
                             f"{self.prefix_snapshot_gib} / {self.snapshot_interval}")
        if self.prefix_snapshots not in ("reused", "all"):
            raise ValueError(f"prefix_snapshots must be reused or all, got {self.prefix_snapshots!r}")
        if self.prefix_host_policy not in ("reused", "all"):
            raise ValueError(f"prefix_host_policy must be reused or all, got {self.prefix_host_policy!r}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is scratch), got {self.num_blocks}")
        if self.kv_pool_gib <= 0:
            raise ValueError(f"kv_pool_gib must be > 0, got {self.kv_pool_gib}")
        if self.max_resident_requests < 1:
            raise ValueError(f"max_resident_requests must be >= 1, got {self.max_resident_requests}")
        if self.kv_block_size is not None and self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")


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
    max_tokens_per_step: int | None = setting(None, "the step's token budget (prefill chunks + decodes + drafts; "
                                                    "default 512 on the CPU, 2048 on CUDA)")
    max_requests_per_step: int = setting(64, "the most requests one step runs")
    admission_hold_steps: int | None = setting(None, "with MTP on, while requests decode, the most steps a new "
                                                     "request waits so that arrivals share one prompt step (0: "
                                                     "admitted at once; "
                                                     f"default 0 on the CPU, {CUDA_ADMISSION_HOLD_STEPS} on CUDA)")
    admission_group: float = setting(0.25, "held requests are admitted together once this many per decoding "
                                           "request wait (0.25: 4 beside 16 decoding)")
    admission_lookahead: int = setting(0, "with a hold's group gathered, admissions still wait (within the hold) "
                                          "while a running request is expected to end within this many steps, "
                                          "at its own tokens per step, so that the arrivals its end brings "
                                          "share the prompt step (0: admitted once the group gathers)")

    def for_device(self, device: str) -> SchedulerConfig:
        """This config with the device's defaults filled in where none was given.

        Token budget: a CPU step's cost grows with its tokens, while on the H200 a 2048-token
        prompt chunk runs far more tokens per second than 512-token ones (1.4 B, 64 prompts at
        once: 2.5x the output throughput) and costs a decode step sharing it about 40 ms.

        Admission holds (MTP engines): on CUDA a prompt step runs eagerly and costs about the
        same for one prompt as for several (ORT's per-node launches, and a recurrent prefill
        kernel that follows the longest prompt), and breaks the draft steps' pipeline:
        ``CUDA_ADMISSION_HOLD_STEPS`` (scheduler rule 2 has the measurements). On the CPU a
        prompt step's cost grows with its tokens, so holding only delays: 0."""
        budget = self.max_tokens_per_step
        hold = self.admission_hold_steps
        return dataclasses.replace(self, max_tokens_per_step=budget if budget is not None else
                                   2048 if device == "cuda" else 512,
                                   admission_hold_steps=hold if hold is not None else
                                   CUDA_ADMISSION_HOLD_STEPS if device == "cuda" else 0)

    def validate(self) -> None:
        if self.max_tokens_per_step is not None and self.max_tokens_per_step < 1 + MAX_DRAFT_TOKENS:
            raise ValueError(f"max_tokens_per_step must be >= {1 + MAX_DRAFT_TOKENS}, "
                             f"got {self.max_tokens_per_step}")
        if self.max_requests_per_step < 1:
            raise ValueError(f"max_requests_per_step must be >= 1, got {self.max_requests_per_step}")
        if self.admission_hold_steps is not None and self.admission_hold_steps < 0:
            raise ValueError(f"admission_hold_steps must be >= 0, got {self.admission_hold_steps}")
        if self.admission_lookahead < 0:
            raise ValueError(f"admission_lookahead must be >= 0, got {self.admission_lookahead}")
        if not 0 < self.admission_group <= 1:
            raise ValueError(f"admission_group must be in (0, 1], got {self.admission_group}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: draft tokens per request per step.

    draft_tokens: a fixed K for every request (0 = MTP off), or "auto": each step's draft depth
    is chosen from its requests' measured acceptance and the replica's measured step cost
    (``AdaptiveDraftPolicy``), up to the model's capture capacity. ``draft_cost`` (a draft
    level's cost in plain decode steps) is the guess where nothing is measured: the planner's
    counts for a replica that has not reported a fit. An integer given as a string ("3") is
    taken as that integer.
    draft_calibration: with "auto", time every decode step shape the policy can choose at
    start-up (``engine/draft_calibration.py``) and judge depths by that table
    (``StepCostTable``) instead of a fit of live steps. Off by default until measured on the
    H200 against the fit.
    synthetic_acceptance: benchmarking only, for models whose MTP head is untrained: the verifier
    accepts each draft with this probability instead of comparing it with the target (greedy
    requests). The output is then NOT the model's; every report labels such runs synthetic.
    """
    draft_tokens: int | str = setting(0, "MTP draft tokens per step: K (0 = off) or auto (each step's depth "
                                         "from its requests' measured acceptance and the step cost)")
    draft_cost: float = setting(DEFAULT_DRAFT_COST, "draft_tokens auto: the cost of a draft level, in plain "
                                                    "decode steps, guessed where it is not measured (the "
                                                    "planner's first counts)")
    synthetic_acceptance: float | None = setting(None, "benchmarks only: accept each draft with this "
                                                       "probability (the output is not the model's)")
    draft_calibration: bool = setting(False, "draft_tokens auto: time a decode step of every batch size class "
                                             "and draft depth at start (seconds; the log says how long) and judge "
                                             "depths by those times instead of fitting live steps (see README, "
                                             "'A known gap on the H200')")

    def __post_init__(self) -> None:
        k = self.draft_tokens
        if isinstance(k, str):
            k = k.strip().lower()
            if k != "auto":
                try:
                    k = int(k)
                except ValueError:
                    raise ValueError(f"draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}] or 'auto', "
                                     f"got {self.draft_tokens!r}") from None
            object.__setattr__(self, "draft_tokens", k)

    @property
    def adaptive(self) -> bool:
        return self.draft_tokens == "auto"

    @property
    def num_draft_tokens(self) -> int:
        """The fixed K (0 when adaptive: the policy chooses)."""
        return 0 if self.adaptive else self.draft_tokens

    def validate(self) -> None:
        k = self.draft_tokens
        if not self.adaptive and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_DRAFT_TOKENS):
            raise ValueError(f"draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}] or 'auto', got {k!r}")
        if self.draft_cost <= 0:
            raise ValueError(f"draft_cost must be > 0, got {self.draft_cost}")
        if self.draft_calibration and not self.adaptive:
            raise ValueError(f"draft_calibration times the depths draft_tokens auto chooses from: it needs "
                             f"draft_tokens auto, got {self.draft_tokens!r}")
        a = self.synthetic_acceptance
        if a is not None and not 0.0 <= a <= 1.0:
            raise ValueError(f"synthetic acceptance must be in [0, 1], got {a}")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str = setting(str(MODEL_DIR), "paged onnxruntime-genai export directory (the default is the "
                                             "bundled model)")
    device: str = setting("cpu", "cpu or cuda")
    num_threads: int = setting(0, "ONNX Runtime intra-op threads (0 = ORT's default)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    fused_replay: bool = setting(True, "CUDA: the commit's partial-keep replay (conv and recurrent rows) in two "
                                       "CUDA kernels instead of CuPy array code")
    warm_up: bool = setting(True, "CUDA: run every decode batch size once at start (ORT's first call of a "
                                  "shape costs 45-85 ms), and the model's matrix products at every token "
                                  "count of a step (cuBLAS loads a kernel on its first use)")
    cuda_graphs: bool = setting(True, "CUDA: capture every decode and uniform verify step shape as a CUDA graph "
                                      "at start and replay them (off: every step runs eagerly, for debugging)")
    prompt_graphs: bool | None = setting(None, "capture prompt steps too (a prompt chunk, alone or beside decode "
                                               "rows, no drafts: varlen graphs by padded batch, total rows and KV "
                                               "bucket) at start and replay them instead of ORT's eager run (~2.3 "
                                               "ms of host time a prompt step on the bundled model); start-up "
                                               "checks a replay against ORT's eager run of the same inputs and the "
                                               "padded logits against the unpadded forward, and keeps the eager "
                                               "path if either differs. Default: on with CUDA graphs (on an H100 "
                                               "the bundled model's K=2 engine 1.11-1.13x faster at 16 requests; "
                                               "the 1.4 B model's 252 shapes took 1.4 GiB and 12.6 s to capture, "
                                               "its engine ready in 44 s against 15 s without), off on the CPU, "
                                               "where on runs the same padded steps eagerly (slower: for tests)")
    prompt_graph_rows: int = setting(512, "CUDA, with prompt_graphs: the most rows in all (prompt chunks and "
                                          "decode rows) of a captured prompt step; a larger one runs eagerly, "
                                          "where its GPU time outweighs the launches a graph saves. It sets the "
                                          "number of shapes, so the capture time (the 1.4 B model on an H100: "
                                          "484 shapes in 41 s up to 2048 rows, 324 in 20 s up to 512)")
    prompt_graph_slot_tokens: int = setting(65536, "CUDA, with prompt_graphs: the most padded requests x KV-bucket "
                                                   "tokens of a captured prompt step (ORT's varlen attention holds "
                                                   "every slot's KV at the bucket's length); a larger step runs "
                                                   "eagerly. This sets the memory: the 1.4 B model's 65 slots at "
                                                   "an 8192-token bucket took 16.4 GiB of ORT's arena on an H100")
    step_recordings: bool | None = setting(None, "CUDA, MTP: a steady draft step (after one of the same requests) "
                                                  "recorded once as a CUDA graph of ours, ORT's forwards and our "
                                                  "kernels in it, and launched as one call for every later step "
                                                  "whose launches are the same (engine/step_recordings.py). "
                                                  "Default: on with CUDA graphs in an MTP engine with real "
                                                  "acceptance (the bundled model's K=2 engine 1.14-1.23x faster at "
                                                  "one request, 0.97-1.04x at 16, on an H200), off elsewhere")
    overlap_decode: bool | None = setting(None, "launch a decode step before the tokens of the step it follows "
                                                "are read, so the GPU runs it while the host handles those "
                                                "(steps without drafts, greedy or sampled; exact). Default: on with "
                                                "CUDA, off on the CPU (nothing runs in parallel there)")
    max_model_len: int | None = setting(None, "longest prompt + output a request may reach (default: the "
                                              "model's context); sizes the KV cache and, on CUDA, the block tables")

    @property
    def uses_prompt_graphs(self) -> bool:
        """``prompt_graphs`` with its default resolved: on with CUDA graphs, off on the CPU."""
        return resolve_prompt_graphs(self.prompt_graphs, self.device, self.cuda_graphs)

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a new one), got {self.max_model_len}")
        if self.prompt_graphs and not self.cuda_graphs:
            raise ValueError("prompt_graphs needs cuda_graphs (prompt steps replay captured graphs too)")
        if self.prompt_graph_rows < 1:
            raise ValueError(f"prompt_graph_rows must be >= 1, got {self.prompt_graph_rows}")
        if self.prompt_graph_slot_tokens < 1:
            raise ValueError(f"prompt_graph_slot_tokens must be >= 1, got {self.prompt_graph_slot_tokens}")
        if self.step_recordings and not self.cuda_graphs:
            raise ValueError("step_recordings needs cuda_graphs (a recorded step runs the captured forwards' bindings)")
        self.cache.validate()
        self.scheduler.validate()
        self.spec.validate()


def resolve_prompt_graphs(prompt_graphs: bool | None, device: str, cuda_graphs: bool) -> bool:
    """``EngineConfig.prompt_graphs`` as given, or its default: on with CUDA graphs, off on the CPU."""
    return prompt_graphs if prompt_graphs is not None else device == "cuda" and cuda_graphs


# ---------------------------------------------------------------------- flat names of nested configs
@dataclass(frozen=True)
class ConfigField:
    """One leaf setting of a nested config: its flat name, where it sits, its type and help."""
    name: str
    path: tuple[str, ...]        # attribute names from the root config down to the leaf
    type: typing.Any             # the annotation (int, float | None, ...)
    default: typing.Any
    help: str


def config_fields(cls) -> dict[str, ConfigField]:
    """Every leaf field of the config dataclass ``cls`` and the ones nested in it, by flat name;
    defaults are those of ``cls()`` (a nested config's default may differ from its class's own)."""
    out: dict[str, ConfigField] = {}
    _collect(cls, cls(), (), out)
    return out


def _collect(cls, defaults, prefix: tuple[str, ...], out: dict[str, ConfigField]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t, default = hints[f.name], getattr(defaults, f.name)
        if dataclasses.is_dataclass(t):
            _collect(t, default, prefix + (f.name,), out)
            continue
        assert f.name not in out, f"config leaf name {f.name!r} is defined twice"
        out[f.name] = ConfigField(f.name, prefix + (f.name,), t, default, f.metadata.get("help", ""))


def from_flat(cls, values: dict, base=None):
    """``cls`` (a nested config) with the flat-named ``values`` set and everything else from
    ``base`` (default: the defaults); ValueError naming any unknown setting."""
    fields = config_fields(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown settings {unknown}; known: {sorted(fields)}")
    tree: dict = {}
    for name, value in values.items():
        node = tree
        *parents, leaf = fields[name].path
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return _build(cls, tree, base)


def _build(cls, tree: dict, base):
    """``base`` (or ``cls()``, whose nested defaults may differ from the nested class's own:
    a server's engine drafts adaptively) with the values in ``tree`` replaced."""
    base = cls() if base is None else base
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in tree.items():
        t = hints[name]
        kwargs[name] = _build(t, value, getattr(base, name)) if dataclasses.is_dataclass(t) else value
    return dataclasses.replace(base, **kwargs)


def to_flat(config) -> dict:
    """The flat-named leaf values of a nested config (the inverse of ``from_flat``)."""
    out = {}
    for name, f in config_fields(type(config)).items():
        value = config
        for p in f.path:
            value = getattr(value, p)
        out[name] = value
    return out
