"""One device's engine: requests in, token events out, one step at a time.

A step is three calls — plan -> execute -> commit:

    plan     StepPlanner picks requests, token counts and drafts, reserving pool space
    execute  drafts: the MTP head catches up on committed rows and chains K drafts;
             verify: one packed main-model forward over every scheduled row
    commit   accept (greedy prefix or exact speculative sampling), CommitPrefix(kept) on the
             KV pool and the state bank, append tokens, check stops, free finished requests

One owner drives it (a step loop); nothing in here is shared across threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from mtpserve.engine.config import EngineConfig, resolve_num_blocks
from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.manifest import ModelManifest, load_manifest
from mtpserve.engine.planner import ScheduledRequest, StepPlanner
from mtpserve.engine.request import FinishReason, Request, RequestStatus, TokenEvent
from mtpserve.engine.runner import PackedRows, Runner
from mtpserve.engine.sampler import SamplingParams, probs, sample, to_host
from mtpserve.engine.speculative import (DraftPolicy, FixedDraftPolicy, SpecDecodeStats, accept_greedy,
                                         propose_drafts, verify_sampled_batch)
from mtpserve.engine.state_bank import FixedLayerSpec, FixedStateSpec, StateBank
from mtpserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("mtpserve")


@dataclass(frozen=True)
class StepTiming:
    """What one step ran and how long it took: the input of a step-cost model."""
    num_requests: int
    num_main_tokens: int        # rows of the main model's forward (fed tokens + drafts)
    num_head_forwards: int      # MTP head forwards (catch-up + chained), = the step's largest K
    has_prefill: bool           # the step carried a prompt chunk
    seconds: float


@dataclass
class _Drafts:
    """This step's drafts of one request, and the distributions they were sampled from."""
    tokens: list[int]
    q: list  # per draft: [V] probs, or None for greedy requests


class Engine:
    """Serves many requests at once on one device; see the module docstring."""

    def __init__(self, config: EngineConfig, draft_policy: DraftPolicy | None = None):
        config.validate()
        self.config = config
        source = load_manifest(config.model_dir)
        if config.device == "cpu":
            from mtpserve.engine.cpu_adapter import adapt_for_cpu
            self.manifest: ModelManifest = load_manifest(adapt_for_cpu(source.path))
            self.xp = np
            self._stream = None
        else:
            import cupy   # the GPU extra: pip install 'mtpserve[gpu]'
            self.manifest = source
            self.xp = cupy
            # one stream for every CuPy op and every ORT run: ordered without host syncs
            self._stream = cupy.cuda.Stream(non_blocking=True)
        with self.device_context():
            self._build(config, draft_policy)
            if self._stream is not None and config.warm_up:
                self._warm_up_decode_shapes()
        if self._stream is not None:
            self._stream.synchronize()

    def _warm_up_decode_shapes(self) -> None:
        """One decode-shaped forward (one token per request, on the scratch block, states zero)
        of the main model and the head at every batch size a step can have: ORT's PagedAttention
        pays 45-85 ms on the first call of each shape, which would otherwise land on live steps."""
        started = time.perf_counter()
        xp, spec = self.xp, self.state_bank.spec
        largest = min(self.config.scheduler.max_requests_per_step, self.config.cache.max_resident_requests)
        logger.info("engine: warming up decode batch sizes 1..%d (a first call of each costs ORT 45-85 ms)", largest)
        for batch in range(1, largest + 1):
            rows = [PackedRows([0], 0, []) for _ in range(batch)]
            self.runner.run_main(rows, spec.zero_states(batch, xp), np.zeros(batch, np.int32))
            if self.runner.head_session is not None:
                self.runner.run_head(rows, xp.zeros((batch, self.manifest.hidden_size), self.runner.hidden_dtype))
        logger.info("engine: warmed up decode batch sizes 1..%d in %.1f s", largest, time.perf_counter() - started)

    def device_context(self):
        """Context in which the engine's device work runs (its CUDA stream; nothing on the CPU)."""
        return self._stream if self._stream is not None else contextlib.nullcontext()

    def _build(self, config: EngineConfig, draft_policy: DraftPolicy | None) -> None:
        if config.max_model_len is not None:
            # every limit downstream (admission, planner, block tables, /v1/models) reads this one
            if config.max_model_len > self.manifest.context_length:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context "
                                 f"{self.manifest.context_length}")
            self.manifest = dataclasses.replace(self.manifest, context_length=config.max_model_len)
        m = self.manifest
        self.tokenizer = Tokenizer(m.path)
        bytes_per_block = sum(2 * m.block_size * l.num_kv_heads * l.head_size * np.dtype(l.dtype).itemsize
                              for l in m.kv_layers)
        num_blocks = resolve_num_blocks(config.cache, m.context_length, m.block_size, bytes_per_block)
        use_mtp = m.mtp is not None and config.spec.num_draft_tokens > 0
        self.runner = Runner(m, num_blocks, config.num_threads, config.device, self.xp, with_head=use_mtp,
                             cuda_stream=self._stream.ptr if self._stream is not None else None)
        self.kv_pool = KVPool(num_blocks, m.block_size)
        self.head_pool = KVPool(num_blocks, m.block_size) if use_mtp else None
        spec = _fixed_state_spec(m)
        fused = None
        if self._stream is not None and config.fused_replay:
            from mtpserve.engine.cuda_kernels import FusedRecurrentReplay
            s = spec.layer_shape
            fused = FusedRecurrentReplay(spec.capacity, s.num_v_heads, s.v_head_dim, s.num_k_heads, s.k_head_dim)
        self.state_bank = StateBank(spec, config.cache.max_resident_requests, self.xp, fused_replay=fused)
        self.draft_policy = draft_policy or FixedDraftPolicy(config.spec.num_draft_tokens)
        self.planner = StepPlanner(config.scheduler, self.kv_pool, self.head_pool, self.state_bank,
                                   self.draft_policy, m.capture_capacity, m.context_length)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stop_ids: dict[str, frozenset[int]] = {}     # token ids that end each request
        self._arrivals = itertools.count()
        self.stats = SpecDecodeStats()
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_step: StepTiming | None = None    # the latest step that ran something
        a = config.spec.synthetic_acceptance
        self._synthetic = np.random.default_rng(0) if a is not None else None

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        """Queue a request. Bad input raises ValueError (the serving edge turns it into a 400)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.manifest.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        context = self.manifest.context_length
        if len(ids) >= context:
            raise ValueError(f"the prompt has {len(ids)} tokens; the longest sequence served (the context) "
                             f"is {context} tokens")
        capacity = (self.kv_pool.num_usable_blocks - 1) * self.manifest.block_size
        needed = min(len(ids) + params.max_tokens, context)
        if needed > capacity:
            raise ValueError(f"prompt + max_tokens = {needed} tokens exceeds the KV cache "
                             f"({capacity} tokens); lower max_tokens")
        req = Request(request_id, ids, params, arrival_index=next(self._arrivals))
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer)
        self._stop_ids[request_id] = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.manifest.eos_token_ids))
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request at any point; its blocks and state row are freed at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        return self._finish(req, FinishReason.ABORT, [])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[TokenEvent]:
        with self.device_context():
            return self._step()

    def _step(self) -> list[TokenEvent]:
        started = time.perf_counter()
        self.last_step = None
        plan = self.planner.plan(self.running, list(self.waiting))
        for req in plan.preempted:
            self.running.remove(req)
        if plan.preempted:
            self.num_preemptions += len(plan.preempted)
            self.waiting.extend(plan.preempted)
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival_index))
        for req in plan.admitted:
            self.waiting.remove(req)
            self.running.append(req)
        self.running.sort(key=lambda r: r.arrival_index)
        if not plan.scheduled:
            return []
        self.num_steps += 1
        # packed in state-row order: a steady batch then reads and writes its bank rows in place
        scheduled = sorted(plan.scheduled, key=lambda s: self.state_bank.row(s.request.request_id))
        drafts = self._propose(s for s in scheduled if s.num_drafts)
        out = self._verify(scheduled, drafts)
        events = self._commit(scheduled, drafts, out)
        self.last_step = StepTiming(len(plan.scheduled), plan.num_tokens,
                                    max((s.num_drafts for s in plan.scheduled), default=0),
                                    any(s.num_tokens > 1 for s in plan.scheduled),
                                    time.perf_counter() - started)
        return events

    def _propose(self, drafting: Iterable[ScheduledRequest]) -> dict[str, _Drafts]:
        """MTP head: catch up on committed rows, then chain single-row forwards for K drafts.

            head row p pairs the main model's hidden[p] with token p+1 and predicts token p+2;
            catch-up rows [num_head, num_computed) end at the newest token, so their last row
            gives d0; chained row num_computed+i-1 takes d(i-1) and the head's own hidden out.
        """
        drafting = list(drafting)
        if not drafting:
            return {}
        rows, hidden = [], []
        for s in drafting:
            r = s.request
            rows.append(PackedRows(r.token_ids[r.num_head + 1:r.num_computed + 1], r.num_head,
                                   self.head_pool.block_table(r.request_id)))
            hidden.extend(r.pending_hidden)
        out = self.runner.run_head(rows, hidden[0] if len(hidden) == 1 else self.xp.concatenate(hidden))
        last = np.cumsum([len(p.token_ids) for p in rows]) - 1
        if last[-1] == len(rows) - 1:                  # one catch-up row each: all rows are last rows
            logits, head_hidden = out.logits, out.hidden
        else:
            last = self.xp.asarray(last)
            logits, head_hidden = out.logits[last], out.hidden[last]
        result: dict[str, _Drafts] = {}
        for s in drafting:
            r = s.request
            r.num_head = r.num_computed
            r.pending_hidden = []
            self.head_pool.commit(r.request_id, r.num_head)
            result[r.request_id] = _Drafts([], [])
        active = drafting
        for i in range(max(s.num_drafts for s in drafting)):
            if i > 0:
                rows = [PackedRows([result[s.request.request_id].tokens[-1]],
                                   s.request.num_computed + i - 1,
                                   self.head_pool.block_table(s.request.request_id)) for s in active]
                out = self.runner.run_head(rows, head_hidden)
                logits, head_hidden = out.logits, out.hidden
            tokens, q = self._draft_tokens(active, logits)
            for j, s in enumerate(active):
                d = result[s.request.request_id]
                d.tokens.append(int(tokens[j]))
                d.q.append(None if q is None or s.request.params.is_greedy else q[j])
            keep = [j for j, s in enumerate(active) if s.num_drafts > i + 1]
            if not keep:
                break
            if len(keep) < len(active):
                active = [active[j] for j in keep]
                rows_kept = self.xp.asarray(np.array(keep))
                logits, head_hidden = logits[rows_kept], head_hidden[rows_kept]
        return result

    def _synthetic_num_accepted(self, num_drafts: int) -> int:
        """Benchmark mode: each draft accepted with the configured probability, up to the first miss."""
        hits = self._synthetic.random(num_drafts) < self.config.spec.synthetic_acceptance
        return int(np.argmin(np.append(hits, False)))

    def _draft_tokens(self, active: list[ScheduledRequest], logits):
        params = [s.request.params for s in active]
        if all(p.is_greedy for p in params):
            return to_host(logits.argmax(axis=1)), None
        return propose_drafts(logits, params, [s.request.rng for s in active], self.xp)

    def _verify(self, scheduled: list[ScheduledRequest], drafts: dict[str, _Drafts]):
        rows = []
        for s in scheduled:
            r = s.request
            tokens = r.token_ids[r.num_computed:r.num_computed + s.num_tokens]
            if s.num_drafts:
                tokens = tokens + drafts[r.request_id].tokens
            rows.append(PackedRows(tokens, r.num_computed, self.kv_pool.block_table(r.request_id)))
        io = self.state_bank.step_buffers([s.request.request_id for s in scheduled])
        capture = np.array([s.num_drafts for s in scheduled], np.int32)
        return self.runner.run_main(rows, io.past, capture, present_into=io.present)

    def _commit(self, scheduled: list[ScheduledRequest], drafts: dict[str, _Drafts], out) -> list[TokenEvent]:
        accepted = self._accept(scheduled, drafts, out.logits)
        events: list[TokenEvent] = []
        num_fed, num_kept, new_tokens = [], [], []
        start = 0
        for s in scheduled:
            r = s.request
            n = s.num_tokens + s.num_drafts
            emitted, kept = [], s.num_tokens
            if s.samples:
                emitted, num_accepted = accepted[r.request_id]
                if s.num_drafts:
                    kept = num_accepted + 1
                r.stats.record_step(s.num_drafts, num_accepted, len(emitted))
                self.stats.record_step(s.num_drafts, num_accepted, len(emitted))
            if self.head_pool is not None:
                r.pending_hidden.append(out.hidden[start:start + kept])
            num_fed.append(n)
            num_kept.append(kept)
            new_tokens.append(emitted)
            start += n
        rids = [s.request.request_id for s in scheduled]
        self.state_bank.commit_step(rids, out.present, num_fed, num_kept, out.captures)
        for s, kept, emitted in zip(scheduled, num_kept, new_tokens):
            r = s.request
            r.num_computed += kept
            self.kv_pool.commit(r.request_id, r.num_computed)
            event = self._append_tokens(r, emitted) if emitted else None
            if event is not None:
                events.append(event)
        return events

    def _accept(self, scheduled: list[ScheduledRequest], drafts: dict[str, _Drafts], logits
                ) -> dict[str, tuple[list[int], int]]:
        """(emitted tokens, drafts accepted) of every request that samples this step.

        A request's target rows are the last 1 + K of its n fed rows (newest real token, then
        its K drafts). Greedy rows are checked on one host copy of the step's argmax; sampled
        rows without drafts are sampled together, sampled rows with drafts verified together,
        each request drawing from its own RNG in step order.
        """
        xp = self.xp
        argmax = None                                     # one device -> host copy, if any greedy row samples
        result: dict[str, tuple[list[int], int]] = {}
        plain, verified = [], []                          # sampled requests: (scheduled, first target row)
        start = 0
        for s in scheduled:
            r = s.request
            n = s.num_tokens + s.num_drafts
            last = start + n - s.num_drafts - 1           # row of the newest real token
            start += n
            if not s.samples:
                continue
            if not r.params.is_greedy:
                (verified if s.num_drafts else plain).append((s, last))
                continue
            if argmax is None:
                argmax = to_host(logits.argmax(axis=1))
            d = drafts[r.request_id].tokens if s.num_drafts else []
            emitted, num_accepted = accept_greedy(argmax[last:last + len(d) + 1], d)
            if self._synthetic is not None and d:
                num_accepted = self._synthetic_num_accepted(len(d))
                emitted = d[:num_accepted] + [int(argmax[last + num_accepted])]
            result[r.request_id] = emitted, num_accepted
        if plain:
            rows = xp.asarray(np.array([last for _, last in plain]))
            tokens = sample(logits[rows], [s.request.params for s, _ in plain],
                            [s.request.rng for s, _ in plain], xp)
            result.update((s.request.request_id, ([int(t)], 0)) for (s, _), t in zip(plain, tokens))
        if verified:
            rows = np.concatenate([np.arange(last, last + s.num_drafts + 1) for s, last in verified])
            params = [s.request.params for s, _ in verified for _ in range(s.num_drafts + 1)]
            target = probs(logits[xp.asarray(rows)], params, xp)
            q = xp.stack([qi for s, _ in verified for qi in drafts[s.request.request_id].q])
            outcomes = verify_sampled_batch(target, q, [drafts[s.request.request_id].tokens for s, _ in verified],
                                            [s.request.rng for s, _ in verified], xp)
            result.update((s.request.request_id, o) for (s, _), o in zip(verified, outcomes))
        return result

    # ------------------------------------------------------------------ tokens out
    def _append_tokens(self, req: Request, tokens: list[int]) -> TokenEvent | None:
        """Append emitted tokens up to the first stop; emit the text that is safe to show."""
        p = req.params
        stop_ids = self._stop_ids[req.request_id]
        finish = None
        added = []
        last = min(p.max_tokens - req.num_output_tokens, self.manifest.context_length - len(req.token_ids))
        for i, t in enumerate(tokens):
            added.append(t)
            if t in stop_ids:
                finish = FinishReason.STOP
                break
            if i + 1 >= last:
                finish = FinishReason.LENGTH
                break
        req.token_ids.extend(added)
        detok = self._detok[req.request_id]
        searched = len(detok.text)
        detok.add(added)
        text_end = len(detok.text)
        if p.stop:
            # only text that the new tokens could have completed a stop string in
            start = max(0, searched - max(map(len, p.stop)) + 1)
            hit = min((i for i in (detok.text.find(s, start) for s in p.stop) if i >= 0), default=-1)
            if hit >= 0:
                finish, text_end = FinishReason.STOP, hit
            elif finish is None:   # hold back what may be the start of a stop string
                text_end = max(req.num_emitted_text, text_end - max(map(len, p.stop)) + 1)
        text = detok.text[req.num_emitted_text:text_end]
        req.num_emitted_text = max(req.num_emitted_text, text_end)
        if finish is not None:
            self.running.remove(req)
            return self._finish(req, finish, added, text)
        return TokenEvent(req.request_id, added, text, None, req.num_prompt_tokens, req.num_output_tokens)

    def _finish(self, req: Request, reason: FinishReason, added: list[int], text: str = "") -> TokenEvent:
        self.planner.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._detok.pop(req.request_id, None)
        self._stop_ids.pop(req.request_id, None)
        return TokenEvent(req.request_id, added, text, reason, req.num_prompt_tokens, req.num_output_tokens)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Pools consistent, and every resident request's KV length equals its state length."""
        self.kv_pool.check_integrity()
        self.state_bank.check_integrity()
        if self.head_pool is not None:
            self.head_pool.check_integrity()
        for r in self.running:
            kv, st = self.kv_pool.committed_len(r.request_id), self.state_bank.committed_len(r.request_id)
            assert kv == st == r.num_computed, (
                f"{r.request_id}: committed KV {kv}, state {st}, engine {r.num_computed}")
        resident = set(self.state_bank.request_ids)
        assert resident == {r.request_id for r in self.running}, "state rows held by non-running requests"
        assert set(self.kv_pool.request_ids) <= resident, "KV blocks held by non-resident requests"
        live = set(self.requests)
        assert set(self._detok) == set(self._stop_ids) == live, "per-request text state of finished requests"

    def is_idle_and_empty(self) -> bool:
        """No requests, and every pool back to empty."""
        return (not self.has_work and self.state_bank.num_resident_rows == 0
                and self.kv_pool.num_free_blocks == self.kv_pool.num_usable_blocks
                and (self.head_pool is None or self.head_pool.num_free_blocks == self.head_pool.num_usable_blocks))


def _fixed_state_spec(m: ModelManifest) -> FixedStateSpec:
    conv = {l.layer_id: l for l in m.conv_layers}
    layers = tuple(
        FixedLayerSpec(layer_id=r.layer_id, conv_dim=conv[r.layer_id].conv_dim,
                       conv_kernel_size=conv[r.layer_id].kernel_size, num_v_heads=r.num_value_heads,
                       v_head_dim=r.value_head_size, num_k_heads=r.num_key_heads,
                       k_head_dim=r.key_head_size, conv_dtype=conv[r.layer_id].dtype)
        for r in m.recurrent_layers)
    return FixedStateSpec(layers, m.capture_capacity)
