"""One device's engine: requests in, token events out, one step at a time.

A step is schedule -> propose -> verify -> commit -> outputs, each owned by one module:

    schedule   Scheduler.schedule(): which requests run, their tokens and drafts, their packed
               rows (StepLayout); pool space reserved for all of it (scheduler.py)
    propose    MTPProposer.propose(): the head catches up on committed rows, chains K drafts
    verify     one packed main-model forward over every scheduled row (runner.py), then
               accept_step(): greedy prefix or exact speculative sampling (speculative.py)
    commit     Scheduler.update_from_output(): KV, head KV and state keep the accepted rows;
               tokens appended up to a stop id or a limit
    outputs    OutputProcessor.process(): text, stop strings; finished requests released

With ``overlap_decode`` (CUDA's default) a step without drafts is launched and committed first
and lands (tokens read, appended, outputs) later, after its continuation, the next decode step of
the same requests, has been launched from its tokens on the device; a greedy draft step is
accepted and its states committed on the device, and the next draft step is launched from that
acceptance: the GPU runs one step while the host finishes the one before (pipeline.py).

One owner drives it (a step loop); nothing in here is shared across threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from mtpserve.engine import launches
from mtpserve.engine.admission import RequestLimits, check_request
from mtpserve.engine.config import EngineConfig, resolve_num_blocks
from mtpserve.engine.draft_policy import AdaptiveDraftPolicy, DraftPolicy, FixedDraftPolicy
from mtpserve.engine.grammar import GrammarCompiler, GrammarManager
from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.manifest import ModelManifest, flash_block_size_to_try, load_manifest, with_block_size
from mtpserve.engine.output import OutputProcessor
from mtpserve.engine.pipeline import (
    ADMISSION_DUE,
    FINISHED,
    LaunchedStep,
    TokenReadback,
    accept_drafts,
    continuation_blocker,
    overlap_blocker,
)
from mtpserve.engine.proposer import MTPProposer
from mtpserve.engine.request import FinishReason, Request, TokenEvent
from mtpserve.engine.row_gather import stack_segments
from mtpserve.engine.runner import PackedRows, Runner
from mtpserve.engine.sampler import SamplingParams, apply_penalties, draw_tokens, probs, row_argmax, token_logprobs
from mtpserve.engine.scheduler import ScheduledRequest, Scheduler, StepLayout, StepOutput, StepPlan
from mtpserve.engine.speculative import MAX_NUM_DRAFTS, SpecDecodeStats, accept_step, warm_up_sampled
from mtpserve.engine.state_bank import FixedLayerSpec, FixedStateSpec, StateBank
from mtpserve.engine.tokenizer import Tokenizer

logger = logging.getLogger("mtpserve")

# --draft-tokens auto calibrates a new batch size's step costs at depths 0 and 1 by turns; with
# overlapped decoding each change of depth stops the pipeline (the next step launches alone), so
# it holds each depth this many steps (on the CPU under CUDA's rules, 16 requests after 4: 7 -> 2
# of the load's first 16 steps launched alone, test_overlap)
CALIBRATION_BURST = 4


@dataclass(frozen=True)
class StepTiming:
    """What one step ran and how long it took: the input of a step-cost model."""
    num_requests: int
    num_main_tokens: int        # rows of the main model's forward (fed tokens + drafts)
    num_head_forwards: int      # MTP head forwards (catch-up + chained), = the step's largest K
    has_prefill: bool           # the step carried a prompt chunk
    seconds: float
    graphed: bool = False       # the main forward replayed a captured CUDA graph
    num_head_rows: int = 0      # rows the head caught up on before drafting (positions since each last drafted)
    # overlapped decoding: True when the step was launched by the step before it (its launch and
    # part of its GPU time were hidden behind that one's), False when it was launched and landed
    # in this call (a step that changes kind, drafting or not, runs alone); None without overlap
    pipelined: bool | None = None


def _unsteady(plan: StepPlan, after: LaunchedStep | None, host_staged: bool = False) -> str | None:
    """Why the draft step ``plan`` is not a steady one (``step_recordings``: after a draft step of
    the same requests, staged from it on the device), or None when it is. ``host_staged``: one
    after a step its inputs could not follow on the device (it carries an ended request's rows,
    staged from the host's lengths) counts as steady too (``Engine.record_host_staged``)."""
    if after is None:
        return "launched alone"
    if not after.num_drafts:
        return "after a decode or prompt step"
    if after.staging is None and not host_staged:
        return "after an unstaged step (eager, or rows of ended requests carried)"
    if plan.request_ids != after.plan.request_ids:
        return "other requests than the step before"
    return None


class Engine:
    """Serves many requests at once on one device; see the module docstring."""

    def __init__(self, config: EngineConfig, draft_policy: DraftPolicy | None = None):
        config.validate()
        config = dataclasses.replace(config, scheduler=config.scheduler.for_device(config.device))
        self.config = config
        # ORT's CUDA provider keeps captured graphs per thread: step the engine on this thread
        # (actors/engine_loop.EngineLoop.launch builds it on its owner thread)
        self.built_on_thread = threading.get_ident()
        self._warned_thread = False
        source = load_manifest(config.model_dir)
        if config.device == "cpu":
            from mtpserve.engine.cpu_adapter import adapt_for_cpu
            self.manifest: ModelManifest = load_manifest(adapt_for_cpu(source.path))
            self.xp = np
            self._stream = None
        else:
            import cupy  # the GPU extra: pip install 'mtpserve[gpu]'
            self.manifest = source
            self.xp = cupy
            # one stream for every CuPy op and every ORT run: ordered without host syncs
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self.manifest = with_block_size(self.manifest, config.cache.kv_block_size)
        flash = flash_block_size_to_try(self.manifest)
        if config.device == "cuda" and flash:
            logger.info("engine: %d-token KV blocks: ORT's PagedAttention gathers each request's KV into dense K "
                        "and V for prompts and verifies; --kv-block-size %d lets its flash kernel read them in place",
                        self.manifest.block_size, flash)
        with self.device_context():
            self._build(config, draft_policy)
            if self.graphs is not None:
                advice = self.capture_memory_advice()
                self.graphs.capture_all(advice=advice)
                if self.proposer is not None and self.proposer.graphs is not None:
                    self.proposer.graphs.capture_all(advice=advice)
            if self.prompt_graphs is not None:
                self._capture_prompt_graphs(self.capture_memory_advice())
            if self._stream is not None and config.warm_up:
                self._warm_up_shapes()
                self._warm_up_gemms()
        if self._stream is not None and config.warm_up:
            self.warm_up_requests()
        if config.spec.adaptive and config.spec.draft_calibration and self.max_drafts:
            self.calibrate_draft_costs()
        if self._stream is not None:
            self._stream.synchronize()
        # start-up leaves many new long-lived objects behind (ORT sessions, captured graphs, the
        # warm-up's requests): collected now, the full collection they are owed (tens of ms on
        # these hosts) does not fall on a live step
        gc.collect()

    def _build(self, config: EngineConfig, draft_policy: DraftPolicy | None) -> None:
        check_settings(config, self.manifest)
        if config.max_model_len is not None:
            # every limit downstream (admission, scheduler, block tables, /v1/models) reads this one
            self.manifest = dataclasses.replace(self.manifest, context_length=config.max_model_len)
        m = self.manifest
        self.tokenizer = Tokenizer(m.path)
        bytes_per_block = sum(2 * m.block_size * l.num_kv_heads * l.head_size * np.dtype(l.dtype).itemsize
                              for l in m.kv_layers)
        num_blocks = resolve_num_blocks(config.cache, m.context_length, m.block_size, bytes_per_block)
        use_mtp = m.mtp is not None and (config.spec.adaptive or config.spec.num_draft_tokens > 0)
        graphs = self._stream is not None and config.cuda_graphs
        self.runner = Runner(m, num_blocks, config.num_threads, config.device, self.xp, with_head=use_mtp,
                             cuda_stream=self._stream.ptr if self._stream is not None else None,
                             cuda_graphs=graphs)
        self.kv_pool = KVPool(num_blocks, m.block_size)
        self.head_pool = KVPool(num_blocks, m.block_size) if use_mtp else None
        # structured output: the compiler is shared with the serving edge, which compiles a
        # request's grammar (off this thread) before it is added, so add_request finds it cached
        self.grammars = GrammarManager(GrammarCompiler(m.path / "tokenizer.json", m.vocab_size, m.eos_token_ids))
        self.proposer = MTPProposer(self.runner, self.head_pool, self.xp, grammars=self.grammars,
                                     max_rows=config.scheduler.max_tokens_per_step) if use_mtp else None
        spec = _fixed_state_spec(m)
        fused = None
        if self._stream is not None and config.fused_replay:
            from mtpserve.engine.cuda_kernels import MAX_CAPACITY, CommitReplay
            s = spec.layer_shape
            if spec.capacity <= MAX_CAPACITY:          # else the array code replays the commit
                fused = CommitReplay(spec.capacity, s.num_v_heads, s.v_head_dim, s.num_k_heads, s.k_head_dim,
                                     config.cache.max_resident_requests)
        num_snapshots = _num_snapshots(config, spec)
        # captured prompt steps pad with a request of their own: one scratch row past the residents'
        # (on the CPU their bindings run eagerly, padded the same way: what the tests exercise)
        # (validate: on only with cuda_graphs; on the CPU bound and run eagerly)
        prompt_graphs = config.uses_prompt_graphs
        scratch = 1 if prompt_graphs else 0
        self.state_bank = StateBank(spec, config.cache.max_resident_requests + scratch, self.xp, fused_replay=fused,
                                    num_snapshots=num_snapshots, scratch_rows=scratch)
        self.prefix_cache = None
        if config.cache.prefix_cache:
            from mtpserve.engine.prefix_cache import PrefixCache
            head_arrays = self.runner.head_kv.arrays.values() if self.head_pool is not None else ()
            budget = config.scheduler.max_tokens_per_step
            interval = config.cache.snapshot_interval or max(m.block_size, budget // m.block_size * m.block_size)
            self.prefix_cache = PrefixCache(m.block_size, self.kv_pool, self.head_pool, self.state_bank,
                                            interval, self.xp, self.runner.kv.arrays.values(),
                                            head_arrays, int(config.cache.prefix_host_gib * 2**30),
                                            offload_all=config.cache.prefix_host_policy == "all",
                                            snapshot_all=config.cache.prefix_snapshots == "all",
                                            hidden_row=(m.hidden_size, self.runner.hidden_dtype) if use_mtp else None)
        self.max_drafts = min(MAX_NUM_DRAFTS, m.capture_capacity) if use_mtp else 0
        self.overlap = config.overlap_decode if config.overlap_decode is not None else config.device == "cuda"
        if draft_policy is None and config.spec.adaptive:
            # overlapped, a change of depth stops the pipeline: calibrate a batch size's depths in runs
            draft_policy = AdaptiveDraftPolicy(self.max_drafts, calibration_burst=CALIBRATION_BURST if self.overlap else 1)
        self.draft_policy = draft_policy or FixedDraftPolicy(config.spec.num_draft_tokens)
        self.graphs = self._step_graphs(config) if graphs else None
        self.prompt_graphs = self._prompt_graphs(config) if prompt_graphs else None
        self.prompt_graphs_off: str | None = None     # why the start-up check turned them off
        if self.graphs is not None and self.proposer is not None:
            from mtpserve.engine.cuda_graphs import HEAD_FILL_ROWS, GraphCatalog, HeadGraphs
            c = self.graphs.catalog
            r = 1 + (self.max_drafts if config.spec.adaptive else config.spec.num_draft_tokens)
            fills = tuple(n for n in HEAD_FILL_ROWS if r < n <= config.scheduler.max_tokens_per_step)
            self.proposer.graphs = HeadGraphs(self.runner, GraphCatalog(
                c.batch_sizes, (1, r, *fills), c.table_widths, c.block_size, banks=(0,),
                max_rows=max(max(c.batch_sizes) * r, *fills)), self.xp, catch_up_rows=r)
        self.scheduler = Scheduler(config.scheduler, self.kv_pool, self.head_pool, self.state_bank,
                                   self.draft_policy, m.capture_capacity, m.context_length, self.prefix_cache)
        self.scheduler.uniform_drafts = self.graphs is not None     # a captured verify has one shape
        self.limits = RequestLimits(m.context_length, m.block_size, self.kv_pool.num_usable_blocks, m.vocab_size)
        self.outputs = OutputProcessor(self.tokenizer)
        # a step's tokens: one a request, or a draft step's K + 1 emitted and the kept count
        self._readback = TokenReadback(config.cache.max_resident_requests * (self.max_drafts + 2), self.xp)
        self._accept_out: dict[tuple[int, int], tuple] = {}      # (batch, K) -> a draft step's accept arrays
        self._in_flight: LaunchedStep | None = None     # launched, not landed (overlapped decoding)
        self.num_continuations = 0                       # steps launched before the one they follow landed
        self.num_draft_continuations = 0                 # ... of them draft steps after a draft step
        self.num_drafts_after_decode = 0                 # ... draft steps after a decode step (draft_after_decode)
        self.num_dead_carried = 0                        # ... draft steps that carried a dead row along
        self.overlap_blockers: dict[str, int] = {}       # why a launched step had no continuation, counted
        # a greedy decode step followed by a draft step in flight (the decode step's token as its one kept
        # row; pipeline.py): on with overlapped decoding on CUDA. On the H100 (bundled model, lengths
        # 64-192) auto with it ran 1.42x / 1.36x K=0 at C=16 / 8 against 1.25x / 1.25x without, K=2
        # 1.00-1.03x its own without; with waves (every request 128 tokens) auto 0.88x against 0.90x.
        # On the CPU the tests turn it on
        self.draft_after_decode = self.overlap and config.device == "cuda"
        # with MTP on, a launched step that fed a prompt lands and its events go out before its
        # continuation is launched (at the start of the next step call), rather than after that
        # launch, which catches the head up on the prompts: a prompt step runs eagerly, so the GPU
        # has little of it left. On the H100 (bundled model, session 28) K=2's and auto's time to
        # first token p50 fell 1-2 ms at C=1 and C=16, throughput unchanged; K=0, whose next
        # launch is one replay, gained ~0.3 ms and lost 1.5-3% (a GPU gap per prompt step)
        self.land_prompts_first = self.proposer is not None
        # with land_prompts_first, the head's catch-up on a launched prompt step's completed
        # prompts (``_catch_up_prompts``) is queued at that launch, while the GPU runs the prompt
        # forward, not in the draft step after it, which is launched with nothing in flight (the
        # GPU waiting for the host: ~0.4-0.9 ms of head-fill host time a prompt step on an H100,
        # session 38's step_timeline.py). On with CUDA: on an H100 (bundled model, K=2, C=16,
        # lengths 64-192, captured prompt steps, switch_ab.py, session 40) 1.014x without it
        on_cuda_with_mtp = self.land_prompts_first and config.device == "cuda"
        self.early_head_catch_up = on_cuda_with_mtp
        # with land_prompts_first, a draft step that would stop for the arrivals due is followed by
        # their prompt step as its continuation (``pipeline``, prompt continuations: its requests
        # one row each, moved on the device), not by a stop and a prompt step launched after it
        # lands (the GPU waiting for the host in between). On with CUDA: on an H100 (bundled
        # model, K=2, C=16, lengths 64-192, captured prompt steps, switch_ab.py, session 40) with
        # the early catch-up 1.057-1.061x without either (K=2 then 1.38x K=0 against 1.30x), on
        # its own 1.049x; on a slower, noisier host of the same loan 0.967x
        self.prompt_continuations = on_cuda_with_mtp
        self.num_prompt_continuations = 0                # prompt steps launched as a draft step's continuation
        self.num_prompts_followed = 0                    # ... of them followed before they landed (_follows_in_flight)
        # a draft step's continuation carries the rows of requests that ended while no waiting
        # request could take their slots (pipeline.py, Scheduler.carries_dead_rows), so a finish
        # does not stop the draft steps' pipeline; off: every finish stops it (the lookahead's
        # test measures holds without it). On the H100 (bundled, K=2, C=16, waves, session 31):
        # off 0.97x on
        self.carry_dead_rows = True
        self._landed_prompt: LaunchedStep | None = None     # such a step, its continuation not yet launched
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.last_step: StepTiming | None = None    # the latest step that ran something
        a = config.spec.synthetic_acceptance
        self._synthetic = np.random.default_rng(0) if a is not None else None
        # a steady draft step recorded as one graph of ours and launched as one (step_recordings.py):
        # on by default where it can be, said only where asked for and it cannot
        self.step_recordings = None
        # recordings of draft steps staged from the host too: at 16 requests with lengths 64-192
        # about half the draft steps carry an ended request's rows (waiting for an admission
        # group), each staged from the host's lengths and so not steady (a CPU count under CUDA's
        # rules, session 41). Off until test_cuda and a GPU's turns say otherwise
        self.record_host_staged = False
        if config.step_recordings is not False:
            why = ("it needs CUDA graphs (CUDA, cuda_graphs on)" if self.graphs is None else
                   "it records draft steps (MTP off)" if self.proposer is None else
                   "synthetic acceptance draws on the host every step" if self._synthetic is not None else None)
            if why is None:
                from mtpserve.engine.step_recordings import StepRecordings
                self.step_recordings = StepRecordings()
            elif config.step_recordings:
                logger.warning("engine: step_recordings is off: %s", why)

    def _step_graphs(self, config: EngineConfig):
        """The captured steps (CUDA): every padded batch size up to the step's request limit, one
        token per request (decode) and 1 + K for each draft count the policy can give, every
        KV-length bucket of the context."""
        from mtpserve.engine.cuda_graphs import GraphCatalog, StepGraphs, graph_batch_sizes, table_width_buckets
        m = self.manifest
        largest = min(config.scheduler.max_requests_per_step, config.cache.max_resident_requests)
        drafts = range(1, self.max_drafts + 1) if config.spec.adaptive else [config.spec.num_draft_tokens]
        counts = tuple(sorted({1} | {1 + k for k in drafts if 0 < k <= self.max_drafts}))
        catalog = GraphCatalog(graph_batch_sizes(largest), counts,
                               table_width_buckets(m.block_size, m.context_length), m.block_size)
        return StepGraphs(self.runner, self.state_bank, catalog, self.xp)

    def _prompt_graphs(self, config: EngineConfig):
        """The captured prompt steps (``EngineConfig.prompt_graphs``): batches up to the step's
        request limit plus the padding request's slot, total rows in powers of two up to the
        step's token budget or ``prompt_graph_rows`` (the smaller), the decode graphs' KV buckets,
        slots x KV bucket within ``prompt_graph_slot_tokens``."""
        from mtpserve.engine.cuda_graphs import (
            PromptCatalog,
            PromptGraphs,
            prompt_batch_sizes,
            prompt_row_buckets,
            table_width_buckets,
        )
        m = self.manifest
        largest = min(config.scheduler.max_requests_per_step, config.cache.max_resident_requests)
        rows = min(config.scheduler.max_tokens_per_step, config.prompt_graph_rows)
        catalog = PromptCatalog(prompt_batch_sizes(largest), prompt_row_buckets(rows),
                                table_width_buckets(m.block_size, m.context_length), m.block_size,
                                max_slot_tokens=config.prompt_graph_slot_tokens)
        return PromptGraphs(self.runner, self.state_bank, catalog, self.xp)

    def _capture_prompt_graphs(self, advice: str) -> None:
        """Capture the prompt steps, then check a replay against ORT's eager run of the same
        inputs and the padded logits against the unpadded forward (``PromptGraphs.check``); on
        a difference, say so and keep prompt steps eager."""
        self.prompt_graphs.capture_all(advice=advice)
        why = self.prompt_graphs.check(self.kv_pool.num_blocks)
        if why is not None:
            logger.warning("engine: captured prompt steps are off: %s; prompt steps run eagerly", why)
            self.prompt_graphs, self.prompt_graphs_off = None, why
        else:
            logger.info("engine: captured prompt steps replay what ORT's eager run computes (start-up check; "
                        "against the unpadded eager forward the logits differ by %.3g at most)",
                        self.prompt_graphs.forward_error)

    def _num_replays(self) -> int:
        """Captured forwards of the main model so far (decode / verify and prompt graphs)."""
        return sum(g.num_replays for g in (self.graphs, self.prompt_graphs) if g is not None)

    def _warm_up_shapes(self) -> None:
        """One eager decode-shaped forward (one token per request, on the scratch block, states
        zero) of the main model and the head at every batch size a step can have: ORT's
        PagedAttention pays 45-85 ms on the first call of each shape, which would otherwise land
        on live steps (with CUDA graphs, on the decode steps that cannot replay one). Then the
        state bank's indexing kernels at every size class a step can need
        (``StateBank.warm_up_kernels``: CuPy builds one on its first use), and with MTP the
        kernels of a draft step in flight (``cuda_kernels.warm_up_accept``: a 0.1 s build seen
        on the first such live step) and the head catch-up's row gather, and on CUDA the sampled
        paths' (``speculative.warm_up_sampled``)."""
        started = time.perf_counter()
        xp, spec = self.xp, self.state_bank.spec
        largest = min(self.config.scheduler.max_requests_per_step, self.config.cache.max_resident_requests)
        logger.info("engine: warming up decode batch sizes 1..%d (a first call of each costs ORT 45-85 ms)", largest)
        for batch in range(1, largest + 1):
            rows = [PackedRows([0], 0, []) for _ in range(batch)]
            self.runner.run_main(rows, spec.zero_states(batch, xp), np.zeros(batch, np.int32))
            if self.runner.head_session is not None:
                self.runner.run_head(rows, xp.zeros((batch, self.manifest.hidden_size), self.runner.hidden_dtype))
        self.state_bank.warm_up_kernels(largest)
        if self.proposer is not None:         # a draft step in flight's accept (no warm-up request reaches it)
            from mtpserve.engine.cuda_kernels import warm_up_accept
            warm_up_accept()
            # the head's eager catch-up stacks pending rows with a gather kernel (also without graphs)
            rows = xp.zeros((2, self.manifest.hidden_size), self.runner.hidden_dtype)
            stack_segments([(rows, 1, 1), (rows, 0, 1)], xp)
        if xp is not np:                      # the sampled paths' kernels, at one row and several
            warm_up_sampled(self.manifest.vocab_size, self.manifest.compute_dtype, xp, max(1, self.max_drafts))
        logger.info("engine: warmed up decode batch sizes 1..%d in %.1f s", largest, time.perf_counter() - started)

    def _warm_up_gemms(self) -> None:
        """The model's matrix products at the row counts a step can have, up to the step's token
        budget (``gemm_warmup.warm_rows``): a prompt or mixed step of a new token count otherwise
        loads cuBLAS kernels on a live step (1.4 B model on the H200: 12-20 ms on most new counts)."""
        from mtpserve.engine.gemm_warmup import model_gemm_shapes, warm_rows, warm_up_gemms
        m = self.manifest
        files = ["model.onnx"] + ([m.mtp.filename] if self.runner.head_session is not None else [])
        shapes = model_gemm_shapes(m.path, files)
        rows = self.config.scheduler.max_tokens_per_step
        logger.info("engine: warming up %d matrix-product shapes at %d row counts up to %d (cuBLAS loads a "
                    "kernel on its first use)", len(shapes), len(warm_rows(rows)), rows)
        seconds = warm_up_gemms(shapes, rows, self.runner.providers, self.xp)
        logger.info("engine: warmed up matrix products in %.1f s", seconds)

    def warm_up_requests(self) -> None:
        """A few short requests through the whole step path before any user's, in two waves of
        two (a greedy and a sampled one each, seeded in the first, not in the second): the second wave prefills while the first decodes,
        so a step carries several decode rows beside several prompt chunks, drafts are verified
        and rolled back (MTP), and greedy and sampled accepts run at batch sizes above one.
        Afterwards the engine is idle and empty, its counters are zero again, and the draft
        policy has forgotten these steps' times and acceptance.

        Several rows of each kind, because CuPy builds a kernel on the first use of each
        arrangement of an op's arrays, which one row does not reach. (The first burst's one slow
        step on the H200, 287-395 ms, was such a build, of the state bank's gather and scatter
        at 32 rows; these requests did not prevent it, ``StateBank.warm_up_kernels`` is meant to.)"""
        started = time.perf_counter()
        bs, vocab = self.manifest.block_size, self.manifest.vocab_size
        n = 2 + 2 * self.max_drafts
        greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=0, max_tokens=n, ignore_eos=True)
        unseeded = dataclasses.replace(seeded, seed=None)     # the other draw (inverse CDF) of the sampler
        for wave in range(2):
            for i, params in enumerate((greedy, seeded if wave == 0 else unseeded)):
                offset = 2 * wave + i                             # distinct prompts: no prefix hits
                prompt = [(7 * t + 11 + 13 * offset) % vocab for t in range(3 * bs + 5)]
                self.add_request(f"<warm-up-{offset}>", prompt, params)
            self.step()                      # the first wave's prompts; then it decodes while the
        while self.has_work:                 # second wave's prompts go in beside it
            self.step()
        assert self.is_idle_and_empty(), "the warm-up requests left something behind"
        self._forget_start_up()
        logger.info("engine: warm-up requests in %.2f s", time.perf_counter() - started)

    def calibrate_draft_costs(self, sizes=None, steps: int = 12):
        """Time a decode step of each batch size (default ``calibration_sizes`` up to the
        step's request limit) at each draft depth, and have an adaptive draft policy judge
        depths by that table (``engine/draft_calibration.py``); returns the table. The engine
        is idle and empty afterwards, its counters zero again."""
        from mtpserve.engine.draft_calibration import calibration_sizes, time_draft_depths
        if sizes is None:
            sizes = calibration_sizes(min(self.config.scheduler.max_requests_per_step,
                                          self.config.cache.max_resident_requests))
        table = time_draft_depths(self, sizes, steps)
        if isinstance(self.draft_policy, AdaptiveDraftPolicy):
            self.draft_policy.set_cost_table(table)
        self._forget_start_up()
        return table

    def _forget_start_up(self) -> None:
        """Counters, the draft policy's start-up knowledge and the prefix cache's statistics as
        before any start-up request (the warm-up's, the draft calibration's)."""
        self.draft_policy.forget_start_up()
        self._landed_prompt = None        # (a start-up request's: it continues nothing live)
        self.num_steps, self.last_step, self.num_continuations, self.num_draft_continuations = 0, None, 0, 0
        self.num_drafts_after_decode = self.num_dead_carried = 0
        self.overlap_blockers.clear()
        self.scheduler.stats = SpecDecodeStats()
        self.scheduler.num_preemptions = 0
        if self.prefix_cache is not None:
            self.prefix_cache.stats = type(self.prefix_cache.stats)()
        for graphs in self.graph_sets().values():
            graphs.num_replays = 0
        if self.graphs is not None:
            self.graphs.num_eager = self.graphs.num_device_drafts = self.graphs.num_steady = 0
        if self.prompt_graphs is not None:
            self.prompt_graphs.num_eager = 0

    def export_prefix(self, prompt: str | list[int]) -> list[tuple[bytes, bytes]]:
        """The cached prefix of ``prompt`` as msgpack records another engine of this model can
        ``import_prefix`` (``PrefixCache.export_records``); [] without a cache or a snapshot."""
        if self.prefix_cache is None:
            return []
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        with self.device_context():
            return self.prefix_cache.export_records(ids)

    def import_prefix(self, records: list[tuple[bytes, bytes]]) -> int:
        """Another engine's ``export_prefix`` into this cache's host tier (restored by the next
        lookup of that prompt); the prompt tokens they cover."""
        return self.prefix_cache.import_records(records) if self.prefix_cache is not None else 0

    def device_context(self):
        """Context in which the engine's device work runs (its CUDA stream; nothing on the CPU)."""
        return self._stream if self._stream is not None else contextlib.nullcontext()

    def graph_sets(self) -> dict:
        """The graph sets this engine replays, by what they run: ``main`` (decode and verify
        steps), ``head`` (the MTP head's drafting), ``prompt`` (prompt steps; on the CPU bound and
        run eagerly); each has ``num_graphs``, ``capture_seconds``, ``memory_bytes`` and
        ``num_replays``. Empty without CUDA graphs or prompt graphs."""
        sets = {"main": self.graphs, "head": self.proposer.graphs if self.proposer is not None else None,
                "prompt": self.prompt_graphs}
        return {what: graphs for what, graphs in sets.items() if graphs is not None}

    def capture_memory_advice(self) -> str:
        """The settings that make this engine's captured graphs smaller, for the error a capture
        that runs out of device memory raises (``cuda_graphs.CaptureOutOfMemory``)."""
        m, tips = self.manifest, []
        flash = flash_block_size_to_try(m)
        if flash:
            tips.append(f"--kv-block-size {flash} (ORT's flash kernel then reads the KV blocks in place; at "
                        f"{m.block_size}-token blocks each verify and MTP-head graph gathers a dense copy of its "
                        "requests' KV)")
        tips.append(f"--max-requests-per-step below {self.config.scheduler.max_requests_per_step} (the largest "
                    "graphs' batch)")
        tips.append(f"--max-model-len below {m.context_length} (the largest KV bucket)")
        if self.proposer is not None:
            tips.append("--draft-tokens 0 (no verify or MTP-head graphs)")
        if self.prompt_graphs is not None:
            tips.append("--prompt-graphs off (prompt steps eager)")
        tips.append("--cuda-graphs off (every step eager: slower decoding)")
        return "Try " + "; ".join(tips) + "."

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    continues: bool = False) -> Request:
        """Queue a request. Bad input raises ValueError (the serving edge turns it into a 400).
        continues: a later request will extend this one (a session's turn): the prefix cache
        snapshots its prompt's boundaries even under the ``reused`` policy, so the next turn hits."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        check_request(ids, params.max_tokens, self.limits, params)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.manifest.eos_token_ids))
        req = Request(request_id, ids, params, arrival_index=next(self._arrivals), stop_token_ids=stop_ids,
                      continues=continues)
        if params.grammar is not None:
            self.grammars.start(request_id, params.grammar)     # compiles unless cached; ValueError if it cannot
        self.outputs.start(req)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request at any point; its blocks and state row are freed at once (a freed
        state row takes the bank's last one: that copy goes on the engine's stream, behind the
        commits of the steps before it)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        with self.device_context():
            self._finish(req, FinishReason.ABORT)
        return TokenEvent(request_id, [], "", FinishReason.ABORT, req.num_prompt_tokens, req.num_output_tokens)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def stats(self) -> SpecDecodeStats:
        """Speculative counters summed over every request's verified steps."""
        return self.scheduler.stats

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def device_wait_s(self) -> float:
        """Seconds the host has waited for a step's tokens to reach it (``TokenReadback.wait_s``):
        in an overlapped loop, near zero when its steps are as long as their host work."""
        return self._readback.wait_s

    # ------------------------------------------------------------------ the step
    def step(self) -> list[TokenEvent]:
        if self._stream is not None and threading.get_ident() != self.built_on_thread and not self._warned_thread:
            self._warned_thread = True
            logger.warning("engine: stepped on a thread other than the one that built it: ONNX Runtime keeps "
                           "CUDA graphs per thread, so each graph is captured again on its first step here "
                           "(build the engine on the thread that steps it, as EngineLoop.launch does)")
        with self.device_context():
            events = self._step()
        self.draft_policy.observe_step(self.last_step)
        return events

    def _step(self) -> list[TokenEvent]:
        started = time.perf_counter()
        self.last_step = None
        flight = self._in_flight
        pipelined = flight is not None
        follow = None
        if flight is not None and flight.num_moved:      # a prompt continuation: followed in flight, or landed first
            self._keep_moved_rows(flight)
            follow = self._continue(flight) if self._follows_in_flight(flight) else None
            if follow is None:
                self._in_flight = None
                return self._land_prompt_first(flight, started, pipelined=True)
            self.num_prompts_followed += 1
        if flight is None and self._landed_prompt is not None:      # its continuation, launched now
            landed, self._landed_prompt = self._landed_prompt, None
            flight = self._continue(landed, landed=True)
            if flight is not None and flight.tokens is None:
                self._pick_tokens(flight)               # sampled: the step before has landed
        if flight is None:
            plan = self.scheduler.schedule()
            for req in plan.preempted:
                if self.proposer is not None:
                    self.proposer.forget(req.request_id)
            if not plan.scheduled:
                return []
            self.num_steps += 1
            if not self.overlap or overlap_blocker(plan, self._picks_on_host, self._host_rule) is not None:
                return self._run_step(plan, started)
            flight = self._launch(plan)
            if self.land_prompts_first and any(s.num_tokens > 1 for s in plan.scheduled):
                return self._land_prompt_first(flight, started, pipelined=False)
        self._in_flight = follow if follow is not None else self._continue(flight)
        events = self._land(flight)
        if self._in_flight is not None and self._in_flight.tokens is None:
            self._pick_tokens(self._in_flight)          # sampled: drawn now that the step before landed
        if self.scheduler.releasing:          # dead rows whose step has landed
            self.scheduler.release_finished(keep=set(self._in_flight.plan.request_ids) if self._in_flight else set())
        plan = flight.plan
        self.last_step = StepTiming(len(plan.scheduled), plan.num_tokens, flight.num_drafts,
                                    any(s.num_tokens > 1 for s in plan.scheduled), time.perf_counter() - started,
                                    graphed=flight.graphed, num_head_rows=flight.num_head_rows, pipelined=pipelined)
        return events

    def _keep_moved_rows(self, flight: LaunchedStep) -> None:
        """The head's pending hidden rows of a prompt continuation's moved requests (their one row
        each), behind the kept rows of the draft step before it, which has landed: at the start
        of the step call after its launch, before anything follows it or it lands."""
        plan = flight.plan
        live = [i for i in range(flight.num_moved) if self.scheduler.is_live(plan.scheduled[i].request)]
        self.proposer.keep_step([plan.request_ids[i] for i in live], flight.hidden,
                                [plan.layout.row_start[i] for i in live], [1] * len(live))

    def _follows_in_flight(self, flight: LaunchedStep) -> bool:
        """Whether the prompt continuation ``flight`` may be followed before it lands, as a decode
        step is (``_continue``; a draft step after it with ``draft_after_decode``): the head
        caught up on its prompts at its launch (``early_head_catch_up``), so its continuation's
        launch is a draft step's, every prompt of it is complete and none of its requests ended
        (else it lands first, and its continuation runs on the live requests)."""
        s = self.scheduler
        return self.early_head_catch_up and all(x.samples and s.is_live(x.request) for x in flight.plan.scheduled)

    def _land_prompt_first(self, flight: LaunchedStep, started: float, pipelined: bool) -> list[TokenEvent]:
        """``land_prompts_first``: the launched step ``flight``, which fed a prompt, lands (with
        nothing in flight: finished requests release now); its continuation is launched at the
        start of the next step call."""
        events = self._land(flight)
        self._landed_prompt = flight
        if self.scheduler.releasing:
            self.scheduler.release_finished()
        plan = flight.plan
        self.last_step = StepTiming(len(plan.scheduled), plan.num_tokens, 0, True, time.perf_counter() - started,
                                    graphed=flight.graphed, pipelined=pipelined)
        return events

    # ------------------------------------------------------------------ overlapped decoding (pipeline.py)
    def _launch(self, plan: StepPlan, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue a step without drafts and commit it (its commit does not depend on its tokens).
        Its tokens are picked on the device and go to the host without a wait, here, or for a
        continuation with sampled requests after the step before it lands (``_pick_tokens``).
        ``after``: the launched step whose tokens this one feeds (a continuation). A step with
        drafts goes to ``_launch_drafting``."""
        if plan.scheduled[0].num_drafts:
            return self._launch_drafting(plan, after)
        replays = self._num_replays()
        if after is None:
            self._keep_prefix_hits(plan)
            out = self._verify(plan, {})
            logits = self._processed(plan, {}, out.logits)
        else:
            out = self._verify_continuation(plan, after)
            logits = out.logits
        flight = LaunchedStep(plan, self._num_replays() > replays, logits,
                              hidden=out.hidden if self.proposer is not None else None)
        if after is None or all(s.request.params.is_greedy for s in plan.scheduled):
            self._pick_tokens(flight)
        kept = [s.num_tokens for s in plan.scheduled]
        self.scheduler.commit_rows(plan, out.present, kept, out.captures)
        if self.proposer is not None:            # the head's catch-up rows: known without the tokens
            self.proposer.keep_step(plan.request_ids, out.hidden, plan.layout.row_start, kept)
            if after is None and self.early_head_catch_up and self.land_prompts_first:
                self._catch_up_prompts(plan)
        return flight

    def _catch_up_prompts(self, plan: StepPlan) -> None:
        """``early_head_catch_up``: the head's catch-up on each prompt the launched step ``plan``
        completed, queued behind it: every row but the last (whose id the step samples, on the
        device), from the step's hidden rows, as the next draft step's ``propose`` would. Only
        completed prompts: an earlier chunk may end where the prefix cache takes a snapshot when
        the step lands, which keeps hidden rows from ``num_head`` on. Their head KV is reserved
        and committed here; a request whose reservation fails catches up later, as before."""
        done = [s.request for s in plan.scheduled if s.num_tokens > 1 and s.request.num_computed
                >= s.request.num_prompt_tokens and s.request.num_computed - s.request.num_head > 1]
        ready = [r for r in done if self.head_pool.reserve(r.request_id, r.num_computed - 1)]
        if not ready:
            return
        self.proposer.catch_up(ready)
        for r in ready:
            self.head_pool.commit(r.request_id, r.num_head)

    def _pick_tokens(self, flight: LaunchedStep) -> None:
        """The launched step's tokens on the device, as ``accept_step`` picks them (greedy: the
        argmax; sampled: ``draw_tokens`` on the processed probabilities, each request's draws in
        step order), and their copy to the host started."""
        plan, logits, xp = flight.plan, flight.logits, self.xp
        rows = plan.layout.target_row
        sampled = [i for i, s in enumerate(plan.scheduled) if s.samples and not s.request.params.is_greedy]
        tokens = row_argmax(logits, xp, rows) if len(sampled) < len(rows) else None
        if sampled:
            requests = [plan.scheduled[i].request for i in sampled]
            target = probs(logits[xp.asarray(np.array([rows[i] for i in sampled], np.int64))],
                           [r.params for r in requests], xp)
            drawn = draw_tokens(target, requests, [0] * len(requests), xp, on_device=True)
            if tokens is None:
                tokens = drawn
            else:
                tokens[xp.asarray(np.array(sampled, np.int64))] = drawn
        flight.tokens, flight.readback, flight.source, flight.logits = tokens, self._readback.send(tokens), self._readback, None

    def _continue(self, flight: LaunchedStep, landed: bool = False) -> LaunchedStep | None:
        """The continuation of ``flight`` launched, or None when it cannot be (the reason counted
        in ``overlap_blockers``): after a decode step one more token per request, its ids those
        ``flight`` samples, still on the device; after a draft step a draft step again, from
        its acceptance on the device (``_launch_drafting``). ``landed``: ``flight`` (a decode
        or prompt step) has landed already, its tokens appended (``land_prompts_first``)."""
        s = self.scheduler
        requests = [x.request for x in flight.plan.scheduled]
        live = [s.is_live(r) for r in requests]
        if landed and flight.num_moved and not all(live):
            # a prompt continuation's dead rows, released as it landed: its continuation runs on the
            # live requests, packed in state-row order again (a release moved the bank's last row)
            keep = sorted((i for i, x in enumerate(live) if x), key=lambda i: self.state_bank.row(requests[i].request_id))
            flight = flight.rows_of(keep, self.xp)
            requests = [requests[i] for i in keep]
            live = [True] * len(keep)
        dead = not all(live)
        why = continuation_blocker(flight.plan, len(s.running), s.admission_due(),
                                   self._host_rule, self.manifest.context_length,
                                   self.max_drafts if flight.num_drafts else 0, landed=landed, live=live,
                                   carry_dead=dead and bool(flight.num_drafts) and self.carry_dead_rows
                                   and s.carries_dead_rows(live.count(False), len(live)))
        k, wanted = 0, None
        running = [r for r, alive in zip(requests, live) if alive] if dead else requests
        if why is None and self.proposer is not None:
            wanted = s.plan_drafts(running)
            if flight.num_drafts:           # (a carried dead row takes the live rows' K: uniform drafts)
                k, why = self._next_drafts(flight, [wanted[0]] * len(requests) if dead else wanted)
            elif any(wanted):
                k, why = self._drafts_after_decode(flight, wanted, landed)
        if why is None:
            # KV for the rows the continuation feeds, counting every row ``flight`` may keep
            ahead = flight.num_drafts + 1 if flight.num_drafts else 0
            if not all(self.kv_pool.reserve(r.request_id, r.num_computed + ahead + 1 + k) for r in requests):
                why = "no KV block for the next token"
            elif k and not all(self.head_pool.reserve(r.request_id, r.num_computed + ahead + k - 1) for r in requests):
                why = "no KV block for the next token"
        if (why in (ADMISSION_DUE, FINISHED) and self.prompt_continuations and self.land_prompts_first
                and flight.num_drafts and not landed and any(live) and s.waiting and not s.holds_admissions()
                and {r.request_id for r in s.running} <= set(flight.plan.request_ids)):
            step = self._launch_prompt_continuation(flight, live)
            if step is not None:
                return step
        if why is not None:
            if wanted is not None:
                s.hold_drafts(running, wanted)          # the policy's answer is the next schedule's plan
            self.overlap_blockers[why] = self.overlap_blockers.get(why, 0) + 1
            return None
        scheduled = [ScheduledRequest(x.request, 1, k) for x in flight.plan.scheduled]
        for x in scheduled:
            x.samples = True            # its token is fed as soon as the launched step has it
        plan = StepPlan(scheduled=scheduled, layout=StepLayout.of(scheduled), request_ids=list(flight.plan.request_ids))
        self.num_steps += 1
        self.num_continuations += 1
        if k and not flight.num_drafts:
            self.num_drafts_after_decode += 1
        elif k:
            self.num_draft_continuations += 1
            self.num_dead_carried += dead
            flight.followed = True       # the continuation's head catches up on its rows
        if dead:
            # a carried dead row is staged from the host's lengths, which stopped with it: on the
            # device its rows moved on, so the continuation is not staged from flight's inputs
            flight.staging = None
        return self._launch(plan, after=flight)

    def _launch_prompt_continuation(self, flight: LaunchedStep, live: list[bool]) -> LaunchedStep | None:
        """``prompt_continuations``: the prompt step of the waiting requests due, launched as the
        continuation of the draft step ``flight``, its live requests first, one row each
        (``pipeline``); or None, and the pipeline stops as without: a request of ``flight``
        needs the host's logits (penalties, a grammar, a min_tokens mask) or may reach the
        context end, its KV does not fit, or no waiting request is admitted (no state row, or the
        first due asks for logprobs: the host picks its tokens, a step that runs to its end).

        ``flight``'s dead rows (``live`` False: requests that ended when the step before it
        landed) are released first, their state rows and blocks free for the arrivals: a release
        is queued on the engine's stream behind ``flight``'s commit, so nothing reads them before
        ``flight`` is done with them (with as many state rows as clients, an arrival has no other
        row), and the moved requests are packed in state-row order again (a release moves the
        bank's last row)."""
        s, k1 = self.scheduler, flight.num_drafts + 1
        requests = [x.request for x in flight.plan.scheduled]
        if any(self._host_rule(r, 0) is not None or len(r.token_ids) + k1 + 1 > self.manifest.context_length
               for r, alive in zip(requests, live) if alive):
            return None
        if not all(live) and s.releasing:
            s.release_finished(keep={r.request_id for r, alive in zip(requests, live) if alive})
        if not s.admission_due():
            return None
        moved = sorted((i for i, alive in enumerate(live) if alive),
                       key=lambda i: self.state_bank.row(requests[i].request_id))
        decoding = [requests[i] for i in moved]
        if not all(self.kv_pool.reserve(r.request_id, r.num_computed + k1 + 1) for r in decoding):
            return None
        plan = s.plan_prompts_beside(decoding, lambda r: r.params.prompt_logprobs is None and r.params.logprobs is None)
        if plan is None:
            return None
        self.num_steps += 1
        self.num_continuations += 1
        self.num_prompt_continuations += 1
        replays = self._num_replays()
        self._keep_prefix_hits(plan)
        out = self._verify_prompt_continuation(plan, flight, moved)
        n = len(moved)
        step = LaunchedStep(plan, self._num_replays() > replays, self._processed(plan, {}, out.logits),
                            hidden=out.hidden, num_moved=n)
        self._pick_tokens(step)
        s.commit_rows(plan, out.present, [x.num_tokens for x in plan.scheduled], out.captures)
        # the admitted requests' hidden rows now (the early catch-up reads them); the moved ones'
        # at the start of the next step call, behind ``flight``'s kept rows (``_keep_moved_rows``)
        self.proposer.keep_step(plan.request_ids[n:], out.hidden, plan.layout.row_start[n:],
                                [x.num_tokens for x in plan.scheduled[n:]])
        if self.early_head_catch_up:
            self._catch_up_prompts(plan)
        return step

    def _verify_prompt_continuation(self, plan: StepPlan, after: LaunchedStep, moved: list[int]):
        """The forward of a prompt continuation of the draft step ``after``: its first requests are
        ``after``'s requests ``moved`` (indices, their acceptance rows), one row each; a captured
        prompt step staged as if ``after`` kept all its rows and moved to its acceptance on the
        device; eagerly from the host's copy of that acceptance (a wait) when none fits."""
        k1, n = after.num_drafts + 1, len(moved)
        tables = [self.kv_pool.block_array(rid) for rid in plan.request_ids]
        admitted = [PackedRows(s.request.token_ids[s.request.num_computed:s.request.num_computed + s.num_tokens],
                               s.request.num_computed, t) for s, t in zip(plan.scheduled[n:], tables[n:])]
        if self.prompt_graphs is not None:
            rows = [PackedRows([0], s.request.num_computed + k1, t) for s, t in zip(plan.scheduled[:n], tables)]
            out = self.prompt_graphs.run(plan.request_ids, rows + admitted, copy_hidden=True,
                                         follow=(after.accepted(), k1, moved))
            if out is not None:
                return out
        launches.escape()            # (the eager forward: a deferred step's launches go first)
        accepted = after.host_accepted()
        rows = []
        for s, b, t in zip(plan.scheduled[:n], moved, tables):
            kept = int(accepted[b, k1])
            rows.append(PackedRows([int(accepted[b, kept - 1])], s.request.num_computed + kept, t))
        io = self.state_bank.step_buffers(plan.request_ids)
        return self.runner.run_main(rows + admitted, io.past, np.zeros(len(plan.scheduled), np.int32),
                                    present_into=io.present)

    def _drafts_after_decode(self, flight: LaunchedStep, wanted: list[int], landed: bool) -> tuple[int, str | None]:
        """``_next_drafts`` for a draft step after the decode step ``flight`` (``draft_after_decode``;
        every request greedy: a draft step is accepted on the device), or why there is none."""
        if not self.draft_after_decode:
            return 0, "the draft policy drafts next"
        if not all(x.request.params.is_greedy for x in flight.plan.scheduled):
            return 0, "the draft policy drafts next, and a request samples"
        return self._next_drafts(flight, wanted, landed)

    def _next_drafts(self, flight: LaunchedStep, wanted: list[int], landed: bool = False) -> tuple[int, str | None]:
        """A draft continuation's K from the policy's answer ``wanted``, as the scheduler would
        plan it (one K for all, within the step's budget and the drafts' cap), or why there is
        none. Without uniform drafts (no CUDA graphs) the scheduler caps a request's K by its
        output left (rule 1), so its requests need room for both steps' tokens; with them, a
        request that ends in ``flight`` is a dead row of the continuation."""
        k = wanted[0]
        if not k or any(w != k for w in wanted):
            return 0, "the draft policy plans no drafts next, or differing ones"
        k = min(k, self.max_drafts)
        if len(wanted) * (1 + k) > self.config.scheduler.max_tokens_per_step:
            return 0, "the draft step exceeds the step's token budget"
        if not self.scheduler.uniform_drafts:       # a request's K would be capped by its output left
            ahead = 0 if landed else flight.num_drafts + 1
            for x in flight.plan.scheduled:
                if x.request.max_output_left <= ahead + k:
                    return 0, "a request may end within the next draft step"
        return k, None

    # ------------------------------------------------------------------ draft steps in flight (pipeline.py)
    def _launch_drafting(self, plan: StepPlan, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue a draft step (every request greedy, one token and K drafts each) and its accept
        and state commit on the device; the host learns the accepted counts when it lands.
        ``after``: the launched step it continues, a draft step or (``draft_after_decode``) a
        decode step (its rows are drafted and verified from that step's acceptance on the device).
        A steady one (after a draft step of the same requests, staged from it) goes as one graph
        with ``step_recordings`` on."""
        if self.step_recordings is not None:
            why = _unsteady(plan, after, self.record_host_staged)
            if why is None:
                self.step_recordings.num_host_staged += after.staging is None
                return self.step_recordings.launch(lambda: self._queue_drafting(plan, after))
            self.step_recordings.skipped[why] += 1
        return self._queue_drafting(plan, after)

    def _queue_drafting(self, plan: StepPlan, after: LaunchedStep | None) -> LaunchedStep:
        """``_launch_drafting``'s device calls queued one by one (or deferred, inside ``step_recordings``)."""
        xp, B, K = self.xp, len(plan.scheduled), plan.scheduled[0].num_drafts
        replays = self._num_replays()
        # the head's catch-up rows: known now, but after a draft step (set when it lands: its kept rows)
        head_rows = 0 if after is not None and after.num_drafts else \
            sum(s.request.num_computed - s.request.num_head for s in plan.scheduled)
        drafts = self.proposer.propose(plan.scheduled, after=after)
        on_device = self._device_drafts(plan, drafts)
        if after is None:           # (no prefix hit: a step that admits a request carries its prompt, no drafts)
            out = self._verify(plan, drafts, on_device)
        else:
            out = self._verify_after(plan, drafts, on_device, after)
        draft_ids = on_device.array if on_device is not None else xp.asarray(
            np.array([drafts[rid].tokens for rid in plan.request_ids], np.int64))
        synthetic = None
        if self._synthetic is not None:                           # the draws accept_step makes, in its order
            a = self.config.spec.synthetic_acceptance
            synthetic = np.array([int(np.argmin(np.append(self._synthetic.random(K) < a, False))) for _ in range(B)])
        if xp is np:              # every row checks a draft or gives the bonus
            accepted, kept = accept_drafts(row_argmax(out.logits, xp).reshape(B, K + 1), draft_ids, synthetic)
        else:
            from mtpserve.engine.cuda_kernels import accept_step_on_device
            accepted, kept = accept_step_on_device(out.logits, draft_ids, synthetic, self._accept_buffers(B, K))
        self.scheduler.commit_states_on_device(plan, out.present, kept, out.captures)
        flight = LaunchedStep(plan, self._num_replays() > replays, tokens=accepted,
                              num_drafts=K, hidden=out.hidden, source=self._readback,
                              num_head_rows=head_rows, staging=out.staging)
        flight.readback = self._readback.send(accepted.reshape(-1))
        return flight

    def _accept_buffers(self, batch: int, k: int):
        """A draft step's ``(accepted [batch, k + 2], kept [batch])`` device arrays: one pair a
        shape for the engine's life, not two allocations a step. Step n + 1's accept overwrites
        step n's pair only after what reads it on the device (n's readback copy, n + 1's follow
        kernels) was queued before it on the engine's one stream; the host reads the readback."""
        pair = self._accept_out.get((batch, k))
        if pair is None:
            pair = self._accept_out[batch, k] = (self.xp.empty((batch, k + 2), np.int64), self.xp.empty(batch, np.int64))
        return pair

    def _verify_after(self, plan: StepPlan, drafts: dict, on_device, after: LaunchedStep):
        """The verify of a draft continuation: a captured step staged as if ``after`` kept all
        its rows and moved to its acceptance on the device; eagerly from the host's copy of that
        acceptance (a wait) when no graph fits. (After a decode step, its one row is committed
        already: the rows start one position earlier than ``num_computed``, as a draft step's
        base.)"""
        k1 = after.num_drafts + 1
        behind = 0 if after.num_drafts else 1
        tables = [self.kv_pool.block_array(rid) for rid in plan.request_ids]
        if self.graphs is not None and on_device is not None:       # (ids on the device: no row objects)
            past = np.fromiter((s.request.num_computed for s in plan.scheduled), np.int64, len(tables))
            out = self.graphs.run_after(plan.request_ids, past + (k1 - behind), tuple(tables),
                                        1 + plan.scheduled[0].num_drafts, copy_hidden=False,
                                        device_drafts=on_device.array, after=(after.accepted(), k1),
                                        follows=after.staging)
            if out is not None:
                return out
        elif self.graphs is not None:          # (the host's drafts: staged from row objects)
            rows = [PackedRows([0] + drafts[rid].tokens, s.request.num_computed - behind + k1, t)
                    for s, rid, t in zip(plan.scheduled, plan.request_ids, tables)]
            out = self.graphs.run(plan.request_ids, rows, [1] * len(rows), copy_hidden=False,
                                  after=(after.accepted(), k1), follows=after.staging)
            if out is not None:
                return out
        launches.escape()            # (the eager verify: a deferred step's launches go first)
        accepted = after.host_accepted()
        rows = []
        for b, (s, rid, t) in enumerate(zip(plan.scheduled, plan.request_ids, tables)):
            kept = int(accepted[b, k1])
            rows.append(PackedRows([int(accepted[b, kept - 1])] + drafts[rid].tokens,
                                   s.request.num_computed - behind + kept, t))
        io = self.state_bank.step_buffers(plan.request_ids)
        capture = np.array([s.num_drafts for s in plan.scheduled], np.int32)
        return self.runner.run_main(rows, io.past, capture, present_into=io.present)

    def _land_drafting(self, flight: LaunchedStep) -> list[TokenEvent]:
        """A launched draft step's acceptance read (the wait): the host's side of its commit
        (lengths; the head's pending rows, or its catch-up if a continuation did it), its
        tokens appended, its events."""
        plan, k1 = flight.plan, flight.num_drafts + 1
        accepted = flight.host_tokens().tolist()            # (lists: one conversion, not one a request)
        kept = [row[k1] for row in accepted]
        live = [self.scheduler.is_live(s.request) for s in plan.scheduled]
        self.scheduler.commit_lengths(plan, kept, head_caught_up=flight.followed)
        if flight.followed and self._in_flight is not None:     # the rows its continuation's head caught up on
            self._in_flight.num_head_rows = sum(kept)
        if not flight.followed:
            alive = [i for i, x in enumerate(live) if x]
            hidden = flight.hidden
            if self.graphs is not None and self.graphs.shares(hidden):
                # a continuation's verify leaves its hidden rows in the replays' own buffer (its
                # continuation's head reads them there, before its own verify writes it); with
                # none launched, nothing has written it since: the rows the head needs later, copied
                hidden = self.graphs.hidden_copies.copy(hidden, hidden.shape[0])
            self.proposer.keep_step([plan.request_ids[i] for i in alive], hidden,
                                    [plan.layout.row_start[i] for i in alive], [kept[i] for i in alive])
        sampled = {rid: (row[:n], n - 1) for rid, row, n in zip(plan.request_ids, accepted, kept)}
        updates = self.scheduler.append_tokens(plan, sampled, kept)
        self.scheduler.cache_prefixes(plan, self.proposer.pending_rows)
        return self._events(updates, {})

    def _verify_continuation(self, plan: StepPlan, after: LaunchedStep):
        """The continuation's forward: a captured decode step whose input ids are copied from
        ``after``'s tokens on the device; eagerly (with the host's ids, after a wait) when none fits."""
        rows = [PackedRows([0], s.request.num_computed, self.kv_pool.block_array(s.request.request_id))
                for s in plan.scheduled]
        if self.graphs is not None:
            out = self.graphs.run(plan.request_ids, rows, [1] * len(rows), copy_hidden=self.proposer is not None,
                                  input_tokens=after.tokens)
            if out is not None:
                return out
        rows = [PackedRows([int(t)], r.past_len, r.block_table) for r, t in zip(rows, after.host_tokens())]
        io = self.state_bank.step_buffers(plan.request_ids)
        return self.runner.run_main(rows, io.past, np.zeros(len(rows), np.int32), present_into=io.present)

    def _land(self, flight: LaunchedStep) -> list[TokenEvent]:
        """A launched step's tokens read (the wait), appended, and turned into events."""
        if flight.num_drafts:
            return self._land_drafting(flight)
        plan = flight.plan
        tokens = flight.host_tokens().tolist()
        sampled = {s.request.request_id: ([t], 0) for s, t in zip(plan.scheduled, tokens) if s.samples}
        updates = self.scheduler.append_tokens(plan, sampled, [s.num_tokens for s in plan.scheduled])
        self._advance_grammars(updates)
        self.scheduler.cache_prefixes(plan, self.proposer.pending_rows if self.proposer is not None else None)
        return self._events(updates, {})

    def _picks_on_host(self, s: ScheduledRequest) -> str | None:
        """Why a scheduled request's part of a step needs the host to pick or score a token from
        the logits after the step (so the step cannot land later), or None."""
        r, p = s.request, s.request.params
        if p.prompt_logprobs is not None and r.num_output_tokens == 0:
            return "prompt_logprobs"
        if s.samples and p.logprobs is not None:
            return "logprobs"
        return None

    def _host_rule(self, r: Request, ahead: int) -> str | None:
        """Why request r's logits from its output position ``num_output_tokens + ahead`` on need
        the host first (its history, its grammar's state or its count go into them), or None."""
        p = r.params              # (logprobs never get here: such a step is not launched, _picks_on_host)
        if p.has_penalties:
            return "penalties"
        if r.request_id in self.grammars:
            return "grammar"
        if p.min_tokens > r.num_output_tokens + ahead and r.stop_token_ids:
            return "min_tokens"
        return None

    def _run_step(self, plan: StepPlan, started: float) -> list[TokenEvent]:
        """A step run to its end: propose, verify, accept, commit, outputs."""
        self._keep_prefix_hits(plan)
        drafting = [s for s in plan.scheduled if s.num_drafts]
        head_rows = sum(s.request.num_computed - s.request.num_head for s in drafting)
        drafts = self.proposer.propose(drafting) if drafting else {}
        replays = self._num_replays()
        out = self._verify(plan, drafts, self._device_drafts(plan, drafts))
        sampled = accept_step(plan.scheduled, plan.layout.target_row, drafts, self._processed(plan, drafts, out.logits),
                              self.xp,
                              self.config.spec.synthetic_acceptance, self._synthetic)
        self._score_prompts(plan, out.logits)
        updates = self.scheduler.update_from_output(plan, StepOutput(sampled, out.present, out.captures))
        self._advance_grammars(updates)
        if self.proposer is not None:
            self.proposer.keep_step([u.request.request_id for u in updates], out.hidden, plan.layout.row_start,
                                    [u.num_kept for u in updates])
        self.scheduler.cache_prefixes(plan, self.proposer.pending_rows if self.proposer is not None else None)
        events = self._events(updates, self._logprobs(plan, updates, out.logits))
        self.last_step = StepTiming(len(plan.scheduled), plan.num_tokens, max((s.num_drafts for s in drafting), default=0),
                                    any(s.num_tokens > 1 for s in plan.scheduled), time.perf_counter() - started,
                                    graphed=self._num_replays() > replays,
                                    num_head_rows=head_rows, pipelined=False if self.overlap else None)
        return events

    def _keep_prefix_hits(self, plan: StepPlan) -> None:
        """The head catches up on each prefix hit's last block, from the entry's hidden rows."""
        if self.proposer is not None:
            for rid, hit in plan.prefix_hits.items():
                assert hit.hidden is not None, "a prefix-cache snapshot without the head's hidden rows"
                self.proposer.keep_hidden(rid, hit.hidden, 0, len(hit.hidden))

    def _advance_grammars(self, updates) -> None:
        if self.grammars:
            for u in updates:
                if u.new_token_ids and u.request.request_id in self.grammars:
                    self.grammars.advance(u.request.request_id, u.new_token_ids)

    def _events(self, updates, logprobs: dict) -> list[TokenEvent]:
        """The step's events (text, stop strings); requests that ended are finished."""
        events = []
        for u in updates:
            if u.new_token_ids:
                event = self.outputs.process(u.request, u.new_token_ids, u.finish_reason,
                                             logprobs.get(u.request.request_id))
                if event.finish_reason is not None:
                    self._finish(u.request, event.finish_reason)
                events.append(event)
        return events

    def _processed(self, plan: StepPlan, drafts: dict, logits):
        """The logits the tokens are chosen from: a copy with each request's penalties, its
        ``min_tokens`` mask (stop ids at -inf before its min_tokens-th token) and its grammar's
        mask (tokens the grammar forbids at -inf) applied to its target rows, row j with the
        history it has there (the output so far plus drafts 0..j-1), exactly as plain decoding
        applies them one token at a time; the logits themselves when no request needs any (and
        for logprobs, which are the raw distribution's)."""
        work = []
        grammars = self.grammars
        for s, row in zip(plan.scheduled, plan.layout.target_row):
            r, p = s.request, s.request.params
            masked = p.min_tokens > r.num_output_tokens and r.stop_token_ids
            if s.samples and (masked or p.has_penalties or (grammars and r.request_id in grammars)):
                work.append((s, row))
        if not work:
            return logits
        xp, out = self.xp, logits.copy()
        grammar_rows, grammar_work = [], []
        for s, row in work:
            r, p = s.request, s.request.params
            output = r.token_ids[r.num_prompt_tokens:]
            draft = drafts[r.request_id].tokens if s.num_drafts else []
            for j in range(s.num_drafts + 1):
                if p.has_penalties:
                    out[row + j] = apply_penalties(out[row + j], p, r.prompt_token_ids, output + draft[:j], xp)
                if r.num_output_tokens + j < p.min_tokens and r.stop_token_ids:
                    out[row + j, xp.asarray(np.asarray(sorted(r.stop_token_ids), np.int64))] = -np.inf
            if grammars and r.request_id in grammars:
                grammar_work.append((r.request_id, draft, len(grammar_rows)))
                grammar_rows.extend(range(row, row + s.num_drafts + 1))
        if grammar_rows:                  # every constrained row of the step in one bitmask
            bitmask = grammars.bitmask(len(grammar_rows))
            for rid, draft, start in grammar_work:
                grammars.fill_row_masks(rid, draft, bitmask, start)
            grammars.mask_rows(out, grammar_rows, bitmask, xp)
        return out

    def _score_prompts(self, plan: StepPlan, logits) -> None:
        """prompt_logprobs: the row at prompt position p scores prompt token p + 1 (collected on
        the request until its first event; a preempted request's recomputed rows change nothing)."""
        rows, tokens, owners = [], [], []
        for s, start in zip(plan.scheduled, plan.layout.row_start):
            r = s.request
            if r.params.prompt_logprobs is None or r.num_output_tokens:
                continue
            if r.prompt_logprobs is None:
                r.prompt_logprobs = {}
            for i in range(s.num_tokens):
                target = r.num_computed + i + 1
                if target < r.num_prompt_tokens and target not in r.prompt_logprobs:
                    rows.append(start + i)
                    tokens.append(r.token_ids[target])
                    owners.append((r, target))
        if rows:
            top = max(r.params.prompt_logprobs for r, _ in owners)
            for (r, target), (t, lp, best) in zip(owners, token_logprobs(logits, rows, tokens, top, self.xp)):
                r.prompt_logprobs[target] = (t, lp, best[:r.params.prompt_logprobs])

    def _logprobs(self, plan: StepPlan, updates, logits) -> dict[str, list]:
        """Log-probabilities of the tokens each request asking for them emitted this step: token j
        of a request came from its target row j (an accepted draft is scored by the verify row
        that checked it, exactly the distribution plain decoding would have used)."""
        asked = [u for u in updates if u.new_token_ids and u.request.params.logprobs is not None]
        if not asked:
            return {}
        first_row = {s.request.request_id: row for s, row in zip(plan.scheduled, plan.layout.target_row)}
        rows = [first_row[u.request.request_id] + j for u in asked for j in range(len(u.new_token_ids))]
        tokens = [t for u in asked for t in u.new_token_ids]
        scored = token_logprobs(logits, rows, tokens, max(u.request.params.logprobs for u in asked), self.xp)
        out, i = {}, 0
        for u in asked:
            n, k = len(u.new_token_ids), u.request.params.logprobs
            out[u.request.request_id] = [(t, lp, top[:k]) for t, lp, top in scored[i:i + n]]
            i += n
        return out

    def _verify(self, plan: StepPlan, drafts: dict, on_device=None):
        """One packed forward of the main model over each request's fed tokens and drafts
        (``on_device``, the step's ``_device_drafts``: drafts still on the device go into a
        captured step from there)."""
        if self.graphs is None:
            on_device = None
        rows = self._step_rows(plan, drafts, placeholders=on_device is not None)
        if self.graphs is not None:
            out = self.graphs.run(plan.request_ids, rows, [s.num_tokens for s in plan.scheduled],
                                  copy_hidden=self.proposer is not None,
                                  device_drafts=on_device.array if on_device is not None else None)
            if out is not None:
                return out
            if on_device is not None:          # no graph for this step after all: the host's ids
                rows = self._step_rows(plan, drafts, placeholders=False)
        if (self.prompt_graphs is not None and any(s.num_tokens > 1 for s in plan.scheduled)
                and not any(s.num_drafts for s in plan.scheduled)):          # a prompt chunk, no drafts
            out = self.prompt_graphs.run(plan.request_ids, rows, copy_hidden=self.proposer is not None)
            if out is not None:
                return out
        io = self.state_bank.step_buffers(plan.request_ids)
        capture = np.array([s.num_drafts for s in plan.scheduled], np.int32)
        return self.runner.run_main(rows, io.past, capture, present_into=io.present)

    def _step_rows(self, plan: StepPlan, drafts: dict, placeholders: bool) -> list[PackedRows]:
        """Each request's fed tokens and drafts (draft ids 0 with ``placeholders``)."""
        rows = []
        for s in plan.scheduled:
            r = s.request
            tokens = r.token_ids[r.num_computed:r.num_computed + s.num_tokens]
            if s.num_drafts:
                tokens = tokens + ([0] * s.num_drafts if placeholders else drafts[r.request_id].tokens)
            rows.append(PackedRows(tokens, r.num_computed, self.kv_pool.block_array(r.request_id)))
        return rows

    @staticmethod
    def _device_drafts(plan: StepPlan, drafts: dict):
        """The step's ``DeviceDrafts`` when its drafts can feed a captured verify from the device:
        every request drafted the same number of tokens, in one device array whose rows are the
        step's requests in order. None otherwise (the host's ids are used)."""
        if not plan.scheduled or not drafts:
            return None
        first = drafts.get(plan.scheduled[0].request.request_id)
        shared = first.device if first is not None else None
        if shared is None or shared.array.shape != (len(plan.scheduled), plan.scheduled[0].num_drafts):
            return None
        for b, s in enumerate(plan.scheduled):
            d = drafts.get(s.request.request_id)
            if d is None or d.device is not shared or d.row != b or d.count != s.num_drafts or s.num_tokens != 1:
                return None
        return shared

    def _finish(self, req: Request, reason: FinishReason) -> None:
        # under a launched step that still writes its rows, its pool space goes when that lands
        flying = self._in_flight is not None and any(s.request is req for s in self._in_flight.plan.scheduled)
        self.scheduler.finish(req, reason, release=not flying)
        self.grammars.forget(req.request_id)
        self.draft_policy.forget(req.request_id)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Pools consistent, every resident request's KV length equals its state length, no
        per-request state (the proposer's hidden rows, grammar matchers) left behind by finished
        requests, and every request of a launched step still holding its state row and KV (a
        dead row's go when that step lands: a release moves state rows the step still writes)."""
        self.scheduler.check_integrity()
        if self._in_flight is not None:
            resident = set(self.state_bank.request_ids)
            released = [rid for rid in self._in_flight.plan.request_ids if rid not in resident
                        or rid not in self.kv_pool]
            assert not released, f"the step in flight writes rows of released requests {released}"
        assert self.grammars.request_ids <= set(self.scheduler.requests), (
            "grammar matchers of finished requests are left")
        if self.proposer is not None:
            assert self.proposer.request_ids <= set(self.scheduler.requests), (
                "the proposer holds hidden rows of finished requests")

    def is_idle_and_empty(self) -> bool:
        """No requests, nothing in flight, and every pool back to empty."""
        return self._in_flight is None and self.scheduler.is_idle_and_empty()


def check_settings(config: EngineConfig, manifest: ModelManifest) -> None:
    """Raise ValueError for a setting an engine of ``manifest`` refuses, without building one:
    ``mtpserve serve`` checks them before it starts Ray (and a replica for each), the engine
    again when it is built."""
    m = with_block_size(manifest, config.cache.kv_block_size)     # (a size the export's graphs fix)
    k = config.spec.num_draft_tokens
    if k and m.mtp is None:
        raise ValueError(f"draft_tokens {k}: this export has no MTP head to draft with (0 or auto serve it)")
    if k > min(MAX_NUM_DRAFTS, m.capture_capacity):
        raise ValueError(f"draft_tokens {k}: this export captures {m.capture_capacity} state transitions a step, so "
                         f"a step verifies at most {min(MAX_NUM_DRAFTS, m.capture_capacity)} drafts (export it with "
                         "a larger --capture-capacity for more)")
    if config.max_model_len is not None and config.max_model_len > m.context_length:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context {m.context_length}")
    interval = config.cache.snapshot_interval
    if interval and interval % m.block_size:
        raise ValueError(f"snapshot_interval must be a positive multiple of the block size {m.block_size}, "
                         f"got {interval}")
    spec = _fixed_state_spec(m)
    if config.cache.prefix_cache and not _num_snapshots(config, spec):
        # no snapshot, no hit: the cache would only cost prompt chunks
        raise ValueError(f"prefix_snapshot_gib {config.cache.prefix_snapshot_gib} holds no state snapshot "
                         f"(one takes {spec.bytes_per_row(num_banks=1)} bytes); raise it or turn prefix_cache off")


def _num_snapshots(config: EngineConfig, spec: FixedStateSpec) -> int:
    """The prefix cache's state snapshots within its budget (0 without the cache)."""
    if not config.cache.prefix_cache:
        return 0
    return min(4096, int(config.cache.prefix_snapshot_gib * 2**30) // spec.bytes_per_row(num_banks=1))


def _fixed_state_spec(m: ModelManifest) -> FixedStateSpec:
    conv = {l.layer_id: l for l in m.conv_layers}
    layers = tuple(
        FixedLayerSpec(layer_id=r.layer_id, conv_dim=conv[r.layer_id].conv_dim,
                       conv_kernel_size=conv[r.layer_id].kernel_size, num_v_heads=r.num_value_heads,
                       v_head_dim=r.value_head_size, num_k_heads=r.num_key_heads,
                       k_head_dim=r.key_head_size, conv_dtype=conv[r.layer_id].dtype)
        for r in m.recurrent_layers)
    return FixedStateSpec(layers, m.capture_capacity)
