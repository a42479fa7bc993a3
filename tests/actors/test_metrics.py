"""Prometheus rendering of several replicas' snapshots, with vLLM-style names."""
from prometheus_client.parser import text_string_to_metric_families

from mtpserve.actors.engine_loop import LoopSnapshot
from mtpserve.actors.metrics import MetricsRecorder, render_metrics
from mtpserve.engine.speculative import SpecDecodeStats


def test_render_labels_each_replica_and_counts_match_what_was_recorded():
    rec = MetricsRecorder()
    rec.observe_ttft(0.003)
    rec.observe_ttft(0.5)
    rec.observe_itl(0.004)
    rec.observe_admission(0.002, 0.03)
    rec.request_finished("length", 5, 16, 0.6)
    rec.error(429)
    spec = SpecDecodeStats()
    spec.record_step(3, 2, 3)
    loop = LoopSnapshot(num_usable_blocks=100, num_free_blocks=75, num_rows=8, num_free_rows=6,
                        num_running=2, num_pending=1, spec=spec, num_steps=40, num_overlapped_steps=31)
    text = render_metrics("m", {"r1": (rec.snapshot(), loop), "r2": (MetricsRecorder().snapshot(), None)}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def get(name, replica="r1", **extra):
        return samples[(name, tuple(sorted({"model_name": "m", "replica": replica, **extra}.items())))]
    assert get("mtpserve:request_success_total", finished_reason="length") == 1
    assert get("mtpserve:request_errors_total", status="429") == 1
    assert get("mtpserve:generation_tokens_total") == 16 and get("mtpserve:prompt_tokens_total") == 5
    assert get("mtpserve:time_to_first_token_seconds_count") == 2
    assert get("mtpserve:time_to_first_token_seconds_bucket", le="0.005") == 1
    assert get("mtpserve:inter_token_latency_seconds_count") == 1
    assert get("mtpserve:request_queue_time_seconds_bucket", le="0.005") == 1
    assert get("mtpserve:request_prefill_time_seconds_bucket", le="0.02") == 0
    assert get("mtpserve:request_prefill_time_seconds_count") == 1
    assert get("mtpserve:kv_cache_usage_perc") == 0.25 and get("mtpserve:state_rows_usage_perc") == 0.25
    assert get("mtpserve:spec_decode_num_drafts_total") == 1
    assert get("mtpserve:spec_decode_num_draft_tokens_total") == 3
    assert get("mtpserve:spec_decode_num_accepted_tokens_total") == 2
    assert get("mtpserve:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert get("mtpserve:engine_steps_total") == 40 and get("mtpserve:engine_overlapped_steps_total") == 31
    assert get("mtpserve:time_to_first_token_seconds_count", replica="r2") == 0


def test_the_planners_session_hand_overs_are_rendered_by_event():
    from mtpserve.actors.handover import HandoverCounts
    counts = HandoverCounts({"handed_over": 3, "taken": 2}, {"handed_over": 3000, "taken": 2000}, 1, 1000)
    text = render_metrics("m", {}, None, counts).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("mtpserve:session_handover_sessions_total", (("event", "taken"), ("model_name", "m")))] == 2
    assert samples[("mtpserve:session_handover_bytes_total", (("event", "handed_over"), ("model_name", "m")))] == 3000
    assert samples[("mtpserve:session_handover_held_bytes", (("model_name", "m"),))] == 1000
    assert "session_handover" not in render_metrics("m", {}).decode()
