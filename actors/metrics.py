"""Serving metrics: recorded on each replica as plain data, rendered for Prometheus anywhere.

Each replica records request counts and latency histograms in a ``MetricsRecorder`` and sends
``MetricsSnapshot``s (plain dataclasses) to the planner with its reports, so a ``/metrics``
scrape that lands on any replica renders every replica's series (label ``replica``). Names
follow vLLM's (``vllm:`` -> ``mtpserve:``) so existing dashboards need only a prefix change:

    mtpserve:request_success_total{finished_reason}      mtpserve:time_to_first_token_seconds
    mtpserve:prompt_tokens_total                          mtpserve:inter_token_latency_seconds
    mtpserve:generation_tokens_total                      mtpserve:e2e_request_latency_seconds
    mtpserve:num_requests_running / _waiting              mtpserve:kv_cache_usage_perc
    mtpserve:spec_decode_num_drafts_total                 mtpserve:state_rows_usage_perc
    mtpserve:spec_decode_num_draft_tokens_total           mtpserve:spec_decode_num_accepted_tokens_total
    mtpserve:spec_decode_num_accepted_tokens_per_pos_total{position}
    mtpserve:num_target_forwards_total                    mtpserve:request_errors_total{status}
    mtpserve:engine_steps_total                           mtpserve:engine_overlapped_steps_total
    mtpserve:request_queue_time_seconds                   mtpserve:request_prefill_time_seconds
    mtpserve:session_handover_sessions_total{event}       mtpserve:session_handover_bytes_total{event}
    mtpserve:session_handover_held_bytes                  (the planner's, ``actors/handover.py``)

Queue time runs from the engine loop's receiving a request to its admission, prefill time from
there to its first tokens leaving the loop (vLLM's queue and prefill times); TTFT runs from the
HTTP handler's entry to the first tokens in it, so TTFT - queue - prefill is the serving path's own.
Inter-token latency is measured between the streamed events of a request; with speculative
decoding one event may carry several tokens (as in vLLM, one observation per engine step).
"""

from __future__ import annotations

import bisect
import copy
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass
class HistogramData:
    """Per-bucket counts (the last one is +Inf), their sum and total."""
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, c in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += c
            out.append((bound, total))
        return out


@dataclass
class MetricsSnapshot:
    """One replica's request-level counters and histograms since it started."""
    num_requests: dict[str, int] = field(default_factory=dict)      # finish reason -> count
    num_errors: dict[str, int] = field(default_factory=dict)        # HTTP status -> count
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttft: HistogramData = field(default_factory=lambda: HistogramData(TTFT_BUCKETS))
    itl: HistogramData = field(default_factory=lambda: HistogramData(ITL_BUCKETS))
    e2e: HistogramData = field(default_factory=lambda: HistogramData(E2E_BUCKETS))
    queue: HistogramData = field(default_factory=lambda: HistogramData(TTFT_BUCKETS))
    prefill: HistogramData = field(default_factory=lambda: HistogramData(TTFT_BUCKETS))

    def histograms(self) -> dict[str, HistogramData]:
        return {"ttft": self.ttft, "itl": self.itl, "e2e": self.e2e, "queue": self.queue, "prefill": self.prefill}


def merge_metrics(snapshots) -> MetricsSnapshot:
    """The sum of several processes' ``MetricsSnapshot``s of one replica (its API servers')."""
    out = MetricsSnapshot()
    for s in snapshots:
        for mine, theirs in ((out.num_requests, s.num_requests), (out.num_errors, s.num_errors)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        out.num_prompt_tokens += s.num_prompt_tokens
        out.num_generation_tokens += s.num_generation_tokens
        for key, theirs in s.histograms().items():
            mine = out.histograms()[key]
            mine.counts = [a + b for a, b in zip(mine.counts, theirs.counts)]
            mine.sum += theirs.sum
    return out


class MetricsRecorder:
    """Thread-safe recording into a ``MetricsSnapshot``; ``snapshot()`` returns a copy."""

    def __init__(self):
        self._data = MetricsSnapshot()
        self._lock = threading.Lock()

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._data.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self._data.itl.observe(seconds)

    def observe_admission(self, queue_s: float, prefill_s: float) -> None:
        """A request's queue and prefill times (its first event's ``queue_s`` and ``prefill_s``)."""
        with self._lock:
            self._data.queue.observe(queue_s)
            self._data.prefill.observe(prefill_s)

    def request_finished(self, finish_reason: str, num_prompt_tokens: int,
                         num_generation_tokens: int, e2e_seconds: float) -> None:
        with self._lock:
            d = self._data
            d.num_requests[finish_reason] = d.num_requests.get(finish_reason, 0) + 1
            d.num_prompt_tokens += num_prompt_tokens
            d.num_generation_tokens += num_generation_tokens
            d.e2e.observe(e2e_seconds)

    def error(self, status: int) -> None:
        with self._lock:
            key = str(status)
            self._data.num_errors[key] = self._data.num_errors.get(key, 0) + 1

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return copy.deepcopy(self._data)


def render_metrics(model_name: str, replicas: dict[str, tuple[MetricsSnapshot, object]],
                   routing: dict[str, int] | None = None, handover=None) -> bytes:
    """Prometheus text for {replica id: (MetricsSnapshot, LoopSnapshot)}, the routers' decisions
    ({decision: requests}, summed over the app's routers: ``router.StateAffinityRouter.counts``) and
    the planner's session hand-overs (a ``handover.HandoverCounts``, or None)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(model_name, replicas, routing or {}, handover))
    return generate_latest(registry)


class _Collector:
    def __init__(self, model_name: str, replicas: dict, routing: dict[str, int], handover):
        self.model_name, self.replicas, self.routing, self.handover = model_name, replicas, routing, handover

    def collect(self):
        labels = ["model_name", "replica"]
        fam = {
            "success": CounterMetricFamily("mtpserve:request_success", "Finished requests.",
                                           labels=labels + ["finished_reason"]),
            "errors": CounterMetricFamily("mtpserve:request_errors", "Requests answered with an error.",
                                          labels=labels + ["status"]),
            "prompt": CounterMetricFamily("mtpserve:prompt_tokens", "Prompt tokens of finished requests.", labels=labels),
            "gen": CounterMetricFamily("mtpserve:generation_tokens", "Generated tokens of finished requests.", labels=labels),
            "ttft": HistogramMetricFamily("mtpserve:time_to_first_token_seconds", "Time to first token.", labels=labels),
            "itl": HistogramMetricFamily("mtpserve:inter_token_latency_seconds", "Time between streamed events.", labels=labels),
            "e2e": HistogramMetricFamily("mtpserve:e2e_request_latency_seconds", "Request latency.", labels=labels),
            "queue": HistogramMetricFamily("mtpserve:request_queue_time_seconds",
                                           "Time from the engine loop's receiving a request to its admission.",
                                           labels=labels),
            "prefill": HistogramMetricFamily("mtpserve:request_prefill_time_seconds",
                                             "Time from a request's admission to its first tokens.", labels=labels),
            "running": GaugeMetricFamily("mtpserve:num_requests_running", "Requests admitted to the engine.", labels=labels),
            "waiting": GaugeMetricFamily("mtpserve:num_requests_waiting", "Requests waiting for admission.", labels=labels),
            "kv": GaugeMetricFamily("mtpserve:kv_cache_usage_perc", "Used fraction of the paged KV pool.", labels=labels),
            "rows": GaugeMetricFamily("mtpserve:state_rows_usage_perc", "Used fraction of the state bank rows.", labels=labels),
            "drafts": CounterMetricFamily("mtpserve:spec_decode_num_drafts", "Target forwards that carried drafts.", labels=labels),
            "draft_tokens": CounterMetricFamily("mtpserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels=labels),
            "accepted": CounterMetricFamily("mtpserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels=labels),
            "per_pos": CounterMetricFamily("mtpserve:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted drafts by position.", labels=labels + ["position"]),
            "forwards": CounterMetricFamily("mtpserve:num_target_forwards", "Target-model forwards that emitted tokens.", labels=labels),
            "steps": CounterMetricFamily("mtpserve:engine_steps", "Engine steps run.", labels=labels),
            "overlapped": CounterMetricFamily("mtpserve:engine_overlapped_steps", "Engine steps launched before the "
                                              "step they follow landed (overlapped decoding).", labels=labels),
            "pc_queries": CounterMetricFamily("mtpserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                              labels=labels),
            "pc_hits": CounterMetricFamily("mtpserve:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                           labels=labels),
            "pc_blocks": GaugeMetricFamily("mtpserve:prefix_cache_blocks", "KV blocks the prefix cache holds.", labels=labels),
            "pc_snapshots": GaugeMetricFamily("mtpserve:prefix_cache_snapshots",
                                              "Recurrent-state snapshots the prefix cache holds.", labels=labels),
        }
        for replica, (m, loop) in sorted(self.replicas.items()):
            lv = [self.model_name, replica]
            for reason, n in sorted(m.num_requests.items()):
                fam["success"].add_metric(lv + [reason], n)
            for status, n in sorted(m.num_errors.items()):
                fam["errors"].add_metric(lv + [status], n)
            fam["prompt"].add_metric(lv, m.num_prompt_tokens)
            fam["gen"].add_metric(lv, m.num_generation_tokens)
            for key, h in m.histograms().items():
                fam[key].add_metric(lv, h.cumulative(), h.sum)
            if loop is None:
                continue
            fam["running"].add_metric(lv, loop.num_running)
            fam["waiting"].add_metric(lv, loop.num_pending)
            fam["kv"].add_metric(lv, 1 - loop.num_free_blocks / max(loop.num_usable_blocks, 1))
            fam["rows"].add_metric(lv, 1 - loop.num_free_rows / max(loop.num_rows, 1))
            s = loop.spec
            fam["drafts"].add_metric(lv, s.num_drafts)
            fam["draft_tokens"].add_metric(lv, s.num_draft_tokens)
            fam["accepted"].add_metric(lv, s.num_accepted_tokens)
            for pos, n in enumerate(s.accepted_per_position):
                fam["per_pos"].add_metric(lv + [str(pos)], n)
            fam["forwards"].add_metric(lv, s.num_target_forwards)
            fam["steps"].add_metric(lv, loop.num_steps)
            fam["overlapped"].add_metric(lv, loop.num_overlapped_steps)
            fam["pc_queries"].add_metric(lv, loop.prefix_cache_queries)
            fam["pc_hits"].add_metric(lv, loop.prefix_cache_hits)
            fam["pc_blocks"].add_metric(lv, loop.prefix_cache_blocks)
            fam["pc_snapshots"].add_metric(lv, loop.prefix_cache_snapshots)
        routed = CounterMetricFamily(
            "mtpserve:router_requests", "Requests routed, by decision: session (its replica), prefix_hit (to the "
            "replica caching the longest prefix), prefix_overloaded (a match, but beyond the load bound), prefix_miss "
            "(no replica caches any of it), no_prefix (prompt unknown or prefix routing off).",
            labels=["model_name", "decision"])
        for decision, n in sorted(self.routing.items()):
            routed.add_metric([self.model_name, decision], n)
        yield from fam.values()
        yield routed
        if self.handover is not None:
            yield from self._handover_families()

    def _handover_families(self):
        h, labels = self.handover, ["model_name", "event"]
        sessions = CounterMetricFamily(
            "mtpserve:session_handover_sessions", "Sessions' cached prefixes handed over by stopping replicas, by "
            "event: handed_over (to the planner), taken (by the session's next replica), dropped (over the budget "
            "or replaced), expired.", labels=labels)
        size = CounterMetricFamily("mtpserve:session_handover_bytes", "Bytes of those records, by event.",
                                   labels=labels)
        for family, counts in ((sessions, h.sessions), (size, h.bytes)):
            for event, n in sorted(counts.items()):
                family.add_metric([self.model_name, event], n)
        held = GaugeMetricFamily("mtpserve:session_handover_held_bytes", "Bytes of handed-over records the "
                                 "planner holds.", labels=["model_name"])
        held.add_metric([self.model_name], h.num_held_bytes)
        yield from (sessions, size, held)
