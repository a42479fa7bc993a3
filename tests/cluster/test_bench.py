"""`mtpserve bench`: figures from hand-built timelines, the real engine on the tiny export, HTTP
against a small local OpenAI-style SSE server, and og.Engine's skip / stall reporting."""
from __future__ import annotations

import argparse
import gc
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mtpserve.cluster.bench import anchor as bench_anchor
from mtpserve.cluster.bench.cli import add_bench_parser
from mtpserve.cluster.bench.engine_driver import (
    CollectionLog,
    EngineSweep,
    attribute_slow_steps,
    recording_counts,
    run_engine_sweep,
    slow_steps,
)
from mtpserve.cluster.bench.report import LoadRun, RequestRecord, summarize, theory_tokens_per_forward
from mtpserve.cluster.bench.workload import (
    Load,
    Workload,
    output_lengths,
    poisson_arrivals,
    random_workload,
    with_shared_prefixes,
)
from mtpserve.cluster.checkpoints import MID, TINY, num_parameters, text_config


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mtpserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def only_json(results_dir: Path) -> dict:
    files = list(results_dir.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def ordered(d: dict) -> bool:
    return d["p50"] <= d["p90"] <= d["p99"]


# ------------------------------------------------------------------ figures, no engine
def test_figures_from_hand_built_timelines():
    fast = RequestRecord("a", 10, arrival_s=0.0)
    for t, n in [(0.1, 1), (0.2, 2), (0.3, 1)]:      # 4 tokens; MTP chunks can carry several
        fast.add_chunk(t, n)
    fast.num_output_tokens, fast.finish_s = 4, 0.3
    slow = RequestRecord("b", 20, arrival_s=0.5)
    for t in (1.5, 2.5):
        slow.add_chunk(t, 1)
    slow.num_output_tokens, slow.finish_s = 2, 2.5
    failed = RequestRecord("c", 5, arrival_s=0.0, error="HTTP 500")
    run = LoadRun("mtpserve", 0, None, 2, None, 2.5, [fast, slow, failed])
    s = summarize(run, slo_ttft_ms=500, slo_tpot_ms=200)
    assert (s["num_completed"], s["num_failed"], s["num_output_tokens"], s["num_prompt_tokens"]) == (2, 1, 6, 30)
    assert s["ttft_ms"]["mean"] == pytest.approx(550.0)                  # 100 and 1000
    assert fast.tpot_s == pytest.approx(0.2 / 3) and slow.tpot_s == pytest.approx(1.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)                   # 100, 100, 1000
    assert s["output_token_throughput"] == pytest.approx(6 / 2.5)
    assert s["goodput"]["num_good"] == 1 and s["goodput"]["fraction"] == pytest.approx(1 / 3, abs=1e-3)
    assert ordered(s["ttft_ms"]) and ordered(s["e2e_ms"])


def test_slow_steps_are_flagged_against_the_median_of_their_own_shape():
    """A first-call cost on live traffic shows as one step far above its shape's median; a
    shape that is slow every time (a big prompt chunk) is not flagged, nor a rare shape without
    peers of its kind and size."""
    decode, chunk = (8, 8, False, True, 0), (4, 2048, True, False, 0)
    seconds = [0.002] * 20 + [0.020] * 6 + [0.0058, 0.0059, 0.5]
    shapes = [decode] * 20 + [chunk] * 6 + [decode, decode, (1, 1, False, False, 0)]
    flagged = slow_steps(seconds, shapes)
    assert [f["step"] for f in flagged] == []                       # below 3 x the 2 ms median; a rare shape
    seconds[5] = 0.0070
    flagged = slow_steps(seconds, shapes)
    assert [(f["step"], f["requests"], f["graphed"]) for f in flagged] == [(5, 8, True)]
    assert flagged[0]["median_ms"] == 2.0 and flagged[0]["median_of"] == "shape"
    # a burst's one slow step has a shape of its own: judged against steps of its kind and size
    seconds += [0.021, 0.4]
    shapes += [(3, 2000, True, False, 0), (32, 2048 - 96, True, False, 0)]
    flagged = slow_steps(seconds, shapes)
    assert [(f["step"], f["median_of"], f["median_ms"]) for f in flagged] == [(5, "shape", 2.0), (30, "similar", 20.0)]
    # drafting steps: the one whose head catches up on whole prompts is other work, not a stall
    draft = (8, 24, False, True, 5)
    seconds += [0.003] * 10 + [0.014, 0.0031]
    shapes += [draft] * 10 + [(8, 24, False, True, 11), (8, 24, False, True, 6)]
    flagged = slow_steps(seconds, shapes)
    assert [f["step"] for f in flagged] == [5, 30]
    seconds[-1] = 0.0095                  # a stall of a step with a catch-up like its peers' is one
    assert [(f["step"], f["median_of"]) for f in slow_steps(seconds, shapes)][-1] == (len(seconds) - 1, "similar")


def test_a_call_that_launched_a_prompt_step_is_judged_among_such_calls():
    """A draft step whose call also launched a prompt step behind it (and queued the head's
    catch-up on its prompts) is marked in its shape: 3-4x a steady call is that work, judged
    against calls that did the same; a stall of one of them is still flagged, and so is a
    plain call as slow."""
    steady, launching = (16, 48, False, True, 6, False), (16, 48, False, True, 6, True)
    seconds = [0.001] * 40 + [0.0035, 0.0032, 0.0036, 0.0034, 0.0033, 0.0035]
    shapes = [steady] * 40 + [launching] * 6
    assert slow_steps(seconds, shapes) == []
    seconds[42] = 0.012                                   # a stall of a launching call
    seconds[7] = 0.0034                                   # a plain call as slow as a launching one
    flagged = slow_steps(seconds, shapes)
    assert [(f["step"], f["median_ms"]) for f in flagged] == [(7, 1.0), (42, 3.5)]
    # without the mark the launching calls would all be flagged against the steady ones
    assert len(slow_steps(seconds, [s[:5] for s in shapes])) == 7
    # one of another size, alone in its shape: judged against launching calls of its size
    flagged = slow_steps(seconds + [0.0036], shapes + [(15, 45, False, True, 6, True)])
    assert [f["step"] for f in flagged] == [7, 42]


def test_a_loads_step_recordings_are_its_own_not_the_engines_so_far():
    """The bench reports a load's recorded draft steps (an engine runs several loads and a
    warm-up): each counter's growth over the load, why steps were not steady likewise; the
    number of recordings held and whether recording stopped, as they stand."""
    before = {"recordings": 3, "launched": 10, "recorded": 3, "queued": 5, "escaped": 1, "allocating": 0,
              "record_s": 0.01, "disabled": None, "skipped": {"launched alone": 2}}
    after = {"recordings": 5, "launched": 40, "recorded": 5, "queued": 9, "escaped": 1, "allocating": 0,
             "record_s": 0.02, "disabled": None, "skipped": {"launched alone": 2, "after a decode or prompt step": 7}}
    out = recording_counts(before, after)
    assert (out["launched"], out["recorded"], out["queued"], out["escaped"]) == (30, 2, 4, 0)
    assert out["skipped"] == {"after a decode or prompt step": 7}
    assert out["recordings"] == 5 and out["disabled"] is None


def test_a_slow_step_says_whether_a_cycle_collection_or_the_device_took_its_time():
    """Each flagged step carries the collections that ran inside it (clipped to the step), the
    host's wait for the device during it and what else its call did; a collection outside
    every slow step is not counted. The log records real collections, by generation, and stops at the block's end."""
    seconds, starts = [0.002] * 10 + [0.012], [0.01 * i for i in range(11)]
    shapes = [(8, 8, False, True, 0)] * 11
    waits = [0.0] * 10 + [0.001]
    collections = [(0.031, 0.0315, 0), (0.1005, 0.1095, 2), (0.1115, 0.2, 1)]
    calls = [{"pipelined": True, "after_prompt_step": False, "prompt_steps_launched": 0}] * 10 + \
        [{"pipelined": False, "after_prompt_step": True, "prompt_steps_launched": 1}]
    flagged = attribute_slow_steps(slow_steps(seconds, shapes), starts, seconds, waits, collections, calls)
    assert [(f["step"], f["gc_generations"], f["device_wait_ms"]) for f in flagged] == [(10, [1, 2], 1.0)]
    assert (flagged[0]["pipelined"], flagged[0]["after_prompt_step"], flagged[0]["prompt_steps_launched"]) == \
        (False, True, 1)          # what else the slow step's call did
    assert flagged[0]["gc_ms"] == pytest.approx(9.0 + 0.5)      # 9 ms inside, the third clipped at the step's end
    log = CollectionLog()
    gc.disable()                              # (no automatic collection among the explicit ones)
    try:
        with log.recording(time.perf_counter()):
            gc.collect(0)
            gc.collect(2)
        gc.collect(1)                                           # after the block: not logged
    finally:
        gc.enable()
    assert [g for _, _, g in log.spans] == [0, 2] and all(b >= a for a, b, _ in log.spans)
    assert set(log.summary()) == {"0", "2"} and log.summary()["2"]["count"] == 1


def test_theory_and_spec_figures():
    assert theory_tokens_per_forward(0.7, 3) == pytest.approx((1 - 0.7 ** 4) / 0.3)
    assert theory_tokens_per_forward(1.0, 3) == 4.0 and theory_tokens_per_forward(0.0, 3) == 1.0
    rec = RequestRecord("a", 3, 0.0, [0.1], [5], 5, 0.1)
    spec = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3, "num_target_forwards": 2,
            "num_emitted_tokens": 5, "accepted_per_position": [2, 1], "drafted_per_position": [2, 2, 2]}
    s = summarize(LoadRun("mtpserve", 3, None, 1, None, 0.1, [rec], spec), None, None)["spec"]
    assert s["acceptance_rate"] == 0.5 and s["acceptance_length"] == 2.5 and s["tokens_per_target_forward"] == 2.5
    assert s["acceptance_rate_per_position"] == [1.0, 0.5, 0.0]        # unaccepted positions count as 0
    assert s["theory_alpha"] == 1.0 and s["theory_tokens_per_forward"] == 4.0


def test_random_prompts_and_poisson_arrivals_are_seeded():
    a, b = random_workload(5, 7, 50, seed=3, exclude=(2,)), random_workload(5, 7, 50, seed=3, exclude=(2,))
    assert a.prompt_ids == b.prompt_ids and all(len(p) == 7 and 2 not in p for p in a.prompt_ids)
    arrivals = poisson_arrivals(200, rate=50.0, seed=1)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert 200 / arrivals[-1] == pytest.approx(50.0, rel=0.25)


def test_shared_prefix_groups_are_seeded_and_new_for_every_load():
    base = random_workload(40, 5, 50, seed=3)
    wl = with_shared_prefixes(base, 32, 4, 50, seed=3, exclude=())
    heads = [tuple(p[:32]) for p in wl.prompt_ids]
    assert len(set(heads)) == 4 and all(p[32:] == b for p, b in zip(wl.prompt_ids, base.prompt_ids))
    assert wl.prompt_ids == with_shared_prefixes(base, 32, 4, 50, seed=3, exclude=()).prompt_ids
    later = wl.prompt_set(1).prompt_ids
    assert not {tuple(p[:32]) for p in later} & set(heads), "a load's prefixes are its own"
    groups = [sorted({i for i, h in enumerate(heads) if h == g}) for g in set(heads)]
    assert sorted(groups) == sorted(sorted({i for i, p in enumerate(later) if tuple(p[:32]) == g})
                                    for g in {tuple(p[:32]) for p in later}), "the same grouping of requests"
    one = with_shared_prefixes(base, 32, 1, 50, seed=3, exclude=())
    assert one.prompt_ids[0][:32] == random_workload(1, 32, 50, seed=4).prompt_ids[0], "one group: as before"


def test_prefix_routing_on_and_off_are_compared_at_each_load():
    from mtpserve.cluster.bench import replicas

    def summary(routing, cached, ttft, tps, split):
        return {"extra": {"num_replicas": 2, "prefix_routing": routing,
                          "prefix_cache": {"cached_fraction": cached},
                          "replica_share": {"requests": split, "max_over_mean": 1.0}},
                "load": "C=8", "concurrency": 8, "num_completed": 32, "output_token_throughput": tps,
                "ttft_ms": {"p50": ttft, "p99": 3 * ttft}}
    rows = replicas.prefix_routing_effect([summary(True, 0.8, 100.0, 150.0, {"a": 17, "b": 15}),
                                           summary(False, 0.5, 250.0, 100.0, {"c": 16, "d": 16})])
    assert len(rows) == 1 and rows[0]["on"]["cached_fraction"] == 0.8 and rows[0]["off"]["ttft_p50_ms"] == 250.0
    assert rows[0]["throughput_ratio"] == 1.5 and rows[0]["ttft_p50_ratio"] == 0.4
    assert "80.0%" in replicas.format_prefix_routing(rows)


def test_model_shapes():
    for shape in (TINY, MID):       # MRoPE sections cover the rotary half-dim (partial factor 0.25)
        assert sum(shape.mrope_section) == shape.head_dim // 8
    assert text_config(MID, {"<|im_end|>": 2, "<|endoftext|>": 0})["layer_types"].count("full_attention") == 6
    assert 1.0e9 < num_parameters(MID) < 1.6e9


# ------------------------------------------------------------------ the real engine (tiny export)
def test_engine_mode_side_by_side(tiny_paged_export, tmp_path, capsys):
    rc = bench(["--model", str(tiny_paged_export), "--draft-tokens", "0,2", "--synthetic-acceptance", "0.7",
                "--concurrency", "1,3", "--num-prompts", "5", "--max-tokens", "6", "--warmup-requests", "1",
                "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    data = only_json(tmp_path)
    results = data["results"]
    assert [(r["num_draft_tokens"], r["concurrency"]) for r in results] == [(0, 1), (0, 3), (2, 1), (2, 3)]
    for r in results:
        assert r["num_completed"] == r["num_requests"] == 5
        assert r["num_output_tokens"] == 5 * 6 == r["spec"]["num_emitted_tokens"]
        assert r["output_token_throughput"] > 0 and r["request_throughput"] > 0
        assert all(ordered(r[key]) for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["goodput"]["num_good"] == 5
        # at C=1 each request's prompt takes a step of its own (or more: chunks end on prefix-cache
        # snapshot boundaries); every run has decode steps besides
        assert (r["extra"]["prompt_steps"] >= 5 if r["concurrency"] == 1 else r["extra"]["prompt_steps"] >= 2)
        assert r["extra"]["prompt_steps"] < r["extra"]["num_steps"]
        assert r["extra"]["overlap"]["dead_rows_carried"] == 0      # the CPU plans no uniform drafts: none carried
        assert r["extra"]["overlap"]["device_wait_ms_per_step"] == 0.0   # the CPU's tokens are on the host already
    k0, k2 = results[0], results[2]
    assert k0["acceptance"] is None and "synthetic" not in k0["label"]
    assert k0["spec"]["tokens_per_target_forward"] == 1.0 and k0["tokens_per_chunk"] == 1.0
    assert k2["acceptance"] == "synthetic" and "synthetic" in k2["label"] and data["synthetic"]["acceptance"] == 0.7
    assert k2["spec"]["theory_tokens_per_forward"] == pytest.approx(1 + 0.7 + 0.49)
    assert k2["spec"]["num_draft_tokens"] > 0 and len(k2["spec"]["acceptance_rate_per_position"]) == 2
    assert {(c["kind"], c["load"]) for c in data["comparisons"]} == {("speedup_vs_k0", "C=1"), ("speedup_vs_k0", "C=3")}
    assert data["machine"]["cpu_count"] >= 1 and data["model"]["vocab_size"] == TINY.vocab_size
    assert "SYNTHETIC" in out and "mtpserve K=2 synthetic a=0.7" in out
    bound = data["batch1_bandwidth_bound"]
    weights = sum(p.stat().st_size for p in Path(tiny_paged_export).glob("model.onnx*"))
    assert bound["weight_file_bytes"] == weights > bound["embedding_bytes_skipped"] > 0
    assert bound["bytes_per_step"] > weights - bound["embedding_bytes_skipped"]
    assert bound["measured_tpot_p50_ms"] == results[0]["tpot_ms"]["p50"] and "bandwidth bound" in out
    try:
        import matplotlib  # noqa: F401
        assert len(list(tmp_path.glob("*.png"))) == 1
    except ImportError:
        assert "no plot: matplotlib is not installed" in out


def test_prompt_graphs_run_every_prompt_step_and_report_their_start_up(tiny_paged_export, tmp_path, capsys):
    """--prompt-graphs on the CPU binds the padded prompt steps (run eagerly): every prompt step
    takes one, and the start-up line and JSON say how many shapes the set holds; without it the
    engine reports no graph set at all."""
    common = ["--model", str(tiny_paged_export), "--draft-tokens", "0", "--concurrency", "2", "--num-prompts", "4",
              "--max-tokens", "4", "--warmup-requests", "1", "--no-plot"]
    assert bench([*common, "--prompt-graphs", "on", "--results-dir", str(tmp_path / "on")]) == 0
    log = capsys.readouterr().err
    [run] = only_json(tmp_path / "on")["results"]
    prompt = run["extra"]["engine"]["graphs"]["prompt"]
    assert prompt["count"] > 0 and prompt["mib"] == 0.0          # (the CPU: bound, nothing on a device)
    assert run["extra"]["prompt_graph_steps"] == run["extra"]["prompt_steps"] >= 2
    assert f"graphs: prompt {prompt['count']} in " in log and "(bound on the CPU, run eagerly)" in log
    assert bench([*common, "--results-dir", str(tmp_path / "off")]) == 0
    assert "resident; no CUDA graphs)" in capsys.readouterr().err
    [run] = only_json(tmp_path / "off")["results"]
    assert run["extra"]["engine"]["graphs"] == {} and run["extra"]["prompt_graph_steps"] is None
    # the catalog's bounds reach the engine: fewer shapes at a lower row bound; none without the graphs
    assert bench([*common, "--prompt-graphs", "on", "--prompt-graph-rows", "64", "--prompt-graph-slot-tokens", "512",
                  "--results-dir", str(tmp_path / "bounded")]) == 0
    [run] = only_json(tmp_path / "bounded")["results"]
    assert 0 < run["extra"]["engine"]["graphs"]["prompt"]["count"] < prompt["count"]
    assert bench([*common, "--prompt-graph-rows", "64", "--results-dir", str(tmp_path / "x")]) == 2
    assert "add --prompt-graphs on" in capsys.readouterr().err


def test_a_sweeps_loads_run_with_start_up_frozen_and_each_engine_is_collected_after(tiny_paged_export, monkeypatch):
    """The in-process bench runs its loads as a serving process does, with what start-up built
    frozen out of the cycle collector's full collections (one of them rescanning it all is a
    step the report flags as slow); after each draft count's loads it unfreezes, so that engine
    (its cycles, its pools) is collected before the next one starts: none is left behind."""
    import gc
    import weakref

    from mtpserve.cluster.bench import engine_driver
    from mtpserve.engine.manifest import load_manifest
    built, frozen_at_loads = [], []
    ready, run_load = engine_driver.ready_engine, engine_driver.run_load

    def tracked(*args, **kwargs):
        engine = ready(*args, **kwargs)
        built.append(weakref.ref(engine))
        return engine

    def counted(*args, **kwargs):
        frozen_at_loads.append(gc.get_freeze_count())
        return run_load(*args, **kwargs)
    monkeypatch.setattr(engine_driver, "ready_engine", tracked)
    monkeypatch.setattr(engine_driver, "run_load", counted)
    sweep = EngineSweep(str(tiny_paged_export), "cpu", 0, (0, 2), None, (Load(concurrency=2),), 4,
                        num_warmup_requests=0)
    runs = run_engine_sweep(sweep, random_workload(4, 9, TINY.vocab_size), load_manifest(tiny_paged_export).block_size,
                            log=lambda m: None)
    assert [r.error for r in runs] == [None, None]
    assert len(frozen_at_loads) == 2 and all(n > 0 for n in frozen_at_loads), frozen_at_loads
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert len(built) == 2 and all(ref() is None for ref in built), "an engine outlived its sweep"


def test_each_load_gets_prompts_of_its_own_so_the_prefix_cache_cannot_answer_it(tiny_paged_export, tmp_path):
    """Random prompts are drawn anew for each load (and the warm-up): a load repeating the one
    before would be all prefix-cache hits, and its TTFT would measure the cache, not the load."""
    rc = bench(["--model", str(tiny_paged_export), "--prompts", "random", "--input-len", "48",
                "--concurrency", "1,2", "--num-prompts", "3", "--max-tokens", "2", "--warmup-requests", "2", "--draft-tokens", "0",
                "--results-dir", str(tmp_path), "--no-plot"])
    assert rc == 0
    results = only_json(tmp_path)["results"]
    assert [r["extra"]["prefix_cache"]["query_tokens"] for r in results] == [3 * 48, 3 * 48]
    assert [r["extra"]["prefix_cache"]["hit_tokens"] for r in results] == [0, 0]
    wl = random_workload(3, 8, 50, seed=1, prefix=[7, 7])
    sets = [wl.prompt_set(i).prompt_ids for i in range(3)]
    assert all(p[:2] == [7, 7] and len(p) == 10 for s in sets for p in s)
    assert len({tuple(p) for s in sets for p in s}) == 9            # no prompt in two sets
    assert wl.prompt_set(2).warmup(2).prompt_ids == sets[0][:2]      # warm-ups draw from set 0


def test_prefix_snapshot_policies_run_side_by_side_with_the_cache_off(tiny_paged_export, tmp_path):
    rc = bench(["--model", str(tiny_paged_export), "--prompts", "random", "--input-len", "40", "--draft-tokens", "0",
                "--concurrency", "2", "--num-prompts", "3", "--max-tokens", "2", "--warmup-requests", "0",
                "--prefix-cache", "on,all,off", "--results-dir", str(tmp_path), "--no-plot"])
    assert rc == 0
    data = only_json(tmp_path)
    systems = {r["system"]: r for r in data["results"]}
    assert set(systems) == {"mtpserve", "mtpserve snapshots-all", "mtpserve no-prefix-cache"}
    assert systems["mtpserve snapshots-all"]["extra"]["prefix_cache"]["snapshots"] == 3   # each prompt's last block
    assert systems["mtpserve"]["extra"]["prefix_cache"]["snapshots"] == 0        # fresh prompts: none (reused)
    assert {c["kind"] for c in data["comparisons"]} == {"prefix_cache_on_vs_off", "snapshots_all_vs_off"}
    assert bench(["--model", str(tiny_paged_export), "--prefix-cache", "sometimes"]) == 2


def test_open_loop_counts_queueing_from_the_scheduled_arrival(tiny_paged_export):
    from mtpserve.engine.manifest import load_manifest
    sweep = EngineSweep(str(tiny_paged_export), "cpu", 0, (0,), None, (Load(request_rate=40.0),), 4,
                        num_warmup_requests=0)
    [run] = run_engine_sweep(sweep, random_workload(6, 9, TINY.vocab_size), load_manifest(tiny_paged_export).block_size,
                             log=lambda m: None)
    assert run.error is None and run.request_rate == 40.0
    assert [r.arrival_s for r in run.records] == poisson_arrivals(6, 40.0, seed=0)   # the sweep's seed
    for r in run.records:
        assert r.chunk_times_s[0] >= r.arrival_s and sum(r.chunk_num_tokens) == r.num_output_tokens == 4
    assert run.duration_s >= run.records[-1].arrival_s


def test_compare_ortgenai_on_cpu_says_it_needs_cuda(tiny_paged_export, tmp_path, capsys):
    rc = bench(["--model", str(tiny_paged_export), "--draft-tokens", "0", "--num-prompts", "1", "--max-tokens", "2",
                "--warmup-requests", "0", "--compare", "ortgenai", "--no-plot", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "needs CUDA" in out
    data = only_json(tmp_path)
    assert "needs CUDA" in data["anchor_note"] and [r["system"] for r in data["results"]] == ["mtpserve"]


def test_the_adaptive_policy_is_benchmarked_beside_fixed_k(model_dir, tmp_path):
    rc = bench(["--model", str(model_dir), "--draft-tokens", "0,auto", "--num-prompts", "4", "--max-tokens", "24",
                "--concurrency", "2", "--warmup-requests", "0", "--no-plot", "--results-dir", str(tmp_path)])
    assert rc == 0
    results = only_json(tmp_path)["results"]
    assert [r["num_draft_tokens"] for r in results] == [0, "auto"]
    auto = results[1]
    assert auto["num_completed"] == 4 and auto["spec"]["num_draft_tokens"] > 0
    assert "theory_tokens_per_forward" not in auto["spec"], "no one K to compare against"


def test_rounds_interleave_the_draft_counts_and_report_each_ratios_median(model_dir, tmp_path, capsys):
    """--rounds: every K at every load once per round, in a rotating order, each engine kept;
    each ratio is taken within its round (random prompts: a prompt set per round and load, the
    same for every K) and reported as the median over rounds, auto against each round's best."""
    rc = bench(["--model", str(model_dir), "--draft-tokens", "0,1,auto", "--num-prompts", "4", "--max-tokens", "8",
                "--concurrency", "2", "--prompts", "random", "--input-len", "8", "--rounds", "3",
                "--warmup-requests", "1", "--no-plot", "--results-dir", str(tmp_path)])
    assert rc == 0
    data = only_json(tmp_path)
    runs = [(r["extra"]["round"], r["num_draft_tokens"]) for r in data["results"]]
    assert runs == [(0, 0), (0, 1), (0, "auto"), (1, 1), (1, "auto"), (1, 0), (2, "auto"), (2, 0), (2, 1)]
    assert all(r["num_completed"] == 4 for r in data["results"])
    speedup = {(c["round"], c["label"]): c["output_token_throughput"] for c in data["comparisons"]
               if c["kind"] == "speedup_vs_k0"}
    by_round = {(r["extra"]["round"], r["num_draft_tokens"]): r["output_token_throughput"] for r in data["results"]}
    for rnd in range(3):
        assert speedup[(rnd, "mtpserve K=1")] == pytest.approx(by_round[(rnd, 1)] / by_round[(rnd, 0)], rel=1e-3)
    medians = {(m["kind"], m["label"]): m for m in data["rounds"]}
    k1 = medians[("speedup_vs_k0", "mtpserve K=1")]
    assert k1["median_output_token_throughput"] == pytest.approx(sorted(k1["rounds"])[1], abs=1e-4)
    auto = medians[("auto_vs_best_fixed", "mtpserve K=auto")]
    for rnd, v in enumerate(auto["rounds"]):
        assert v == pytest.approx(by_round[(rnd, "auto")] / max(by_round[(rnd, 0)], by_round[(rnd, 1)]), rel=1e-3)
    assert "median" in capsys.readouterr().out
    assert bench(["--rounds", "2", "--url", "http://127.0.0.1:9", "--results-dir", str(tmp_path)]) == 2
    assert "--rounds interleaves the in-process engines only" in capsys.readouterr().err


def test_auto_timed_runs_auto_on_a_table_timed_at_start_beside_the_others(model_dir, tmp_path):
    """--draft-tokens auto-timed: the adaptive policy on a step-cost table timed at start-up
    (--draft-calibration on), labelled apart, compared with K=0 and the best fixed K like auto,
    its table and what live steps said of it in the run's JSON."""
    rc = bench(["--model", str(model_dir), "--draft-tokens", "0,auto-timed", "--num-prompts", "4", "--max-tokens", "8",
                "--concurrency", "2", "--warmup-requests", "1", "--no-plot", "--results-dir", str(tmp_path)])
    assert rc == 0
    data = only_json(tmp_path)
    timed = [r for r in data["results"] if r["num_draft_tokens"] == "auto-timed"]
    assert len(timed) == 1 and timed[0]["num_completed"] == 4 and timed[0]["label"] == "mtpserve K=auto-timed"
    table = timed[0]["extra"]["draft_table"]
    assert table["sizes"] == [1, 2] and len(table["ms"][0]) == 5 and table["live"]
    kinds = {(c["kind"], c["label"]) for c in data["comparisons"]}
    assert {("speedup_vs_k0", "mtpserve K=auto-timed"), ("auto_vs_best_fixed", "mtpserve K=auto-timed")} <= kinds
    assert "theory_tokens_per_forward" not in timed[0]["spec"]
    assert bench(["--model", str(model_dir), "--draft-tokens", "auto-fast", "--results-dir", str(tmp_path)]) == 2


def test_phases_split_each_step_by_engine_phase_and_change_no_output(model_dir, tmp_path, capsys):
    """--phases on: ms per step of each phase, prefill and decode steps apart; the outermost phases
    and "other" add up to the step, a nested phase fits inside its caller, and the timed engine
    emits what an untimed one does (the wrappers return what the methods return)."""
    args = ["--model", str(model_dir), "--draft-tokens", "2", "--num-prompts", "3", "--max-tokens", "12",
            "--concurrency", "2", "--warmup-requests", "0", "--no-plot", "--save-requests"]
    assert bench([*args, "--results-dir", str(tmp_path / "plain")]) == 0
    assert bench([*args, "--phases", "on", "--results-dir", str(tmp_path / "timed")]) == 0
    plain, timed = only_json(tmp_path / "plain"), only_json(tmp_path / "timed")
    assert "phases" not in plain["results"][0]["extra"]
    phases = timed["results"][0]["extra"]["phases"]
    # each prompt step is followed by a decode-only step of its own kind (the pipeline's restart)
    assert set(phases) == {"prefill", "after_prefill", "decode"}
    assert 1 <= phases["after_prefill"]["steps"] <= phases["prefill"]["steps"]
    steps = sum(p["steps"] for p in phases.values())
    assert steps == timed["results"][0]["extra"]["num_steps"]
    for kind, p in phases.items():
        ms = p["phases_ms_per_step"]
        outer = [n for n in ms if n in {"schedule", "propose", "verify", "processed", "accept_step", "score_prompts",
                                        "update_from_output", "keep_hidden", "cache_prefixes", "logprobs",
                                        "outputs.process", "launch", "land", "observe_step", "other"}]
        assert sum(ms[n] for n in outer) == pytest.approx(p["ms_per_step"], rel=1e-3, abs=1e-3), kind
        assert ms["main eager"] <= ms["verify"] and ms["commit_step"] <= ms["update_from_output"], kind
        assert {"schedule", "verify", "accept_step", "update_from_output"} <= set(ms), kind
    assert "head eager" in phases["decode"]["phases_ms_per_step"]    # K=2: the head drafts
    assert "head eager" in phases["after_prefill"]["phases_ms_per_step"]    # on the new prompts' rows too
    tokens = [[r["num_output_tokens"] for r in load["records"]] for load in plain["requests"]]
    assert [[r["num_output_tokens"] for r in load["records"]] for load in timed["requests"]] == tokens
    assert timed["results"][0]["spec"] == plain["results"][0]["spec"]     # same drafts, same acceptance
    assert "ms per step by engine phase" in capsys.readouterr().out


def test_range_ratio_gives_each_request_its_own_seeded_output_length(tiny_paged_export, tmp_path):
    """--range-ratio 0.5: each request generates its own length, drawn from 8 x [0.5, 1.5] (seeded,
    the same in every run), and the JSON says the range; the prompts are those of a run without it."""
    lens = output_lengths(6, 8, 0.5, seed=0)
    assert lens == output_lengths(6, 8, 0.5, seed=0) != output_lengths(6, 8, 0.5, seed=1)
    assert all(4 <= n <= 12 for n in lens) and len(set(lens)) > 1
    assert output_lengths(6, 8, 0.0) is None
    rc = bench(["--model", str(tiny_paged_export), "--draft-tokens", "0", "--concurrency", "2", "--num-prompts", "6",
                "--max-tokens", "8", "--range-ratio", "0.5", "--warmup-requests", "1", "--save-requests", "--no-plot",
                "--results-dir", str(tmp_path)])
    assert rc == 0
    data = only_json(tmp_path)
    [r] = data["results"]
    assert r["num_completed"] == 6 and r["num_output_tokens"] == sum(lens)
    [run] = data["requests"]
    by_index = {int(x["request_id"].rsplit("-", 1)[1]): x["num_output_tokens"] for x in run["records"]}
    assert [by_index[i] for i in range(6)] == lens
    assert data["workload"]["output_tokens"] == {"range_ratio": 0.5, "min": min(lens), "max": max(lens)}


def test_og_driver_and_http_give_each_request_its_workload_length(fake_server):
    """The workload's per-request lengths reach og.Engine's options and the HTTP body alike."""
    lens = [2, 5, 3]
    workload = Workload([[1, 2], [3], [4, 5, 6]], None, output_lens=lens)
    sweep = bench_anchor.AnchorSweep("unused", (0,), (Load(concurrency=2),), 4)
    run = bench_anchor.og_run_load(FakeOg, FakeOg.Engine(), workload, Load(concurrency=2), 0, sweep)
    assert [r.num_output_tokens for r in run.records] == lens
    from mtpserve.cluster.bench.http_driver import HttpTarget, run_http_loads
    FakeOpenAI.state.update(max_in_flight=0, bodies=[])
    target = HttpTarget(fake_server, "fake-model", None, 4, 0.0, True, 30.0, 0, True, 1)
    [run] = run_http_loads(target, [(Load(concurrency=1), workload)], log=lambda *a: None)
    assert sorted(b["max_tokens"] for b in FakeOpenAI.state["bodies"]) == sorted(lens)
    assert [r.num_output_tokens for r in run.records] == lens


def test_bad_arguments_are_refused(tmp_path, capsys):
    assert bench(["--concurrency", "1", "--request-rate", "2", "--results-dir", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
    assert bench(["--synthetic-acceptance", "0.7", "--temperature", "1", "--results-dir", str(tmp_path)]) == 2
    assert "greedy" in capsys.readouterr().err
    assert bench(["--draft-tokens", "0,x", "--results-dir", str(tmp_path)]) == 2
    assert bench(["--prefix-routing", "on,maybe", "--results-dir", str(tmp_path)]) == 2
    assert "--prefix-routing" in capsys.readouterr().err
    assert bench(["--nodes", "2", "--results-dir", str(tmp_path)]) == 2       # no cluster is started for it
    assert "a head and at least two worker nodes" in capsys.readouterr().err
    assert bench(["--nodes", "9", "--results-dir", str(tmp_path)]) == 2
    assert "3 <= N <= 8" in capsys.readouterr().err
    assert bench(["--nodes", "3", "--replicas", "2", "--results-dir", str(tmp_path)]) == 2
    assert "starts its own cluster" in capsys.readouterr().err
    assert bench(["--direct-ingress", "--replicas", "0,2", "--results-dir", str(tmp_path)]) == 2
    assert "--direct-ingress measures one replica" in capsys.readouterr().err
    assert bench(["--direct-ingress", "--results-dir", str(tmp_path)]) == 2
    assert bench(["--range-ratio", "1", "--results-dir", str(tmp_path)]) == 2
    assert "--range-ratio must be in [0, 1)" in capsys.readouterr().err
    assert bench(["--range-ratio", "0.5", "--nodes", "3", "--results-dir", str(tmp_path)]) == 2
    assert "drop --range-ratio" in capsys.readouterr().err
    assert bench(["--range-ratio", "0.5", "--serving-overhead", "--requests", "1", "--results-dir", str(tmp_path)]) == 2
    assert "--serving-overhead sends requests of its own" in capsys.readouterr().err
    assert bench(["--prompt-graphs", "on", "--url", "http://127.0.0.1:9", "--results-dir", str(tmp_path)]) == 2
    assert "--prompt-graphs sets the in-process engine" in capsys.readouterr().err
    assert bench(["--prompt-graphs", "on", "--cuda-graphs", "off", "--results-dir", str(tmp_path)]) == 2
    assert "--prompt-graphs needs --cuda-graphs on" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ og.Engine plumbing
def test_shadow_export_sets_ogs_options_and_leaves_the_export_alone(tiny_paged_export, tmp_path):
    before = (tiny_paged_export / "genai_config.json").read_text()
    shadow = bench_anchor.shadow_export(tiny_paged_export, tmp_path / "shadow", 3, 4096, 32)
    cfg = json.loads((shadow / "genai_config.json").read_text())
    assert cfg["model"]["mtp"]["enabled"] is True and cfg["speculative"] == {"max_draft_tokens": 3}
    assert cfg["engine"]["dynamic_batching"]["num_blocks"] == 4096
    assert json.loads((shadow / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    assert (shadow / "model.onnx").resolve() == (tiny_paged_export / "model.onnx").resolve()
    shadow = bench_anchor.shadow_export(tiny_paged_export, tmp_path / "shadow", 0, 4096, 32)
    cfg = json.loads((shadow / "genai_config.json").read_text())
    assert cfg["model"]["mtp"]["enabled"] is False and "speculative" not in cfg
    assert (tiny_paged_export / "genai_config.json").read_text() == before
    og = pytest.importorskip("onnxruntime_genai")
    try:                             # og's config parser accepts every key we wrote
        og.Model(str(shadow))
    except Exception as e:           # noqa: BLE001 - without CUDA it fails later, at session creation
        assert "JSON" not in str(e) and "parsing" not in str(e), e


class FakeOg:
    """Just enough of onnxruntime_genai for og_run_load: one token per pending request per run()."""

    class TurnOptions:
        def __init__(self, request):
            self.request = request

        def set_max_generated_tokens(self, n):
            self.request.max_tokens = n

        def set_min_generated_tokens(self, n):
            pass

        def set_do_sample(self, flag):
            pass

    class Event:
        def __init__(self, request, flags):
            self.request, self.flags, self.error_code = request, flags, 0
            self.finish_reason = "FinishReason.MAX_GENERATED_TOKENS"

    class Request:
        def __init__(self, engine):
            self.engine, self.num_generated, self.max_tokens = engine, 0, 0

        def begin_turn(self, tokens, options):
            self.engine.pending.append(self)

    class Engine:
        def __init__(self, stall_after: int | None = None):
            self.pending, self.num_runs, self.stall_after = [], 0, stall_after

        def create_request(self):
            return FakeOg.Request(self)

        def create_event_buffer(self, n):
            return None

        def get_speculative_stats(self):
            return {"target_forward_passes": self.num_runs}

        def has_pending_requests(self):
            return bool(self.pending)

        def run(self, buffer):
            self.num_runs += 1
            if self.stall_after is not None and self.num_runs > self.stall_after:
                time.sleep(0.01)
                return []
            events = []
            for r in list(self.pending):
                r.num_generated += 1
                done = r.num_generated == r.max_tokens
                events.append(FakeOg.Event(r, bench_anchor.TOKEN | (bench_anchor.TURN_FINISHED if done else 0)))
                if done:
                    self.pending.remove(r)
            return events


def test_og_driver_counts_tokens_and_reports_a_stall_instead_of_hanging():
    sweep = bench_anchor.AnchorSweep("unused", (0,), (Load(concurrency=2),), 3, stall_s=0.3)
    workload = Workload([[1, 2], [3], [4, 5, 6]], None)
    run = bench_anchor.og_run_load(FakeOg, FakeOg.Engine(), workload, Load(concurrency=2), 0, sweep, 3)
    assert run.error is None and [r.num_output_tokens for r in run.records] == [3, 3, 3]
    assert run.records[2].arrival_s == run.records[0].finish_s    # closed loop: the third replaced the first
    assert summarize(run)["num_completed"] == 3
    started = time.perf_counter()
    run = bench_anchor.og_run_load(FakeOg, FakeOg.Engine(stall_after=2), workload, Load(concurrency=2), 0, sweep, 3)
    assert time.perf_counter() - started < 5
    assert "stalled" in run.error and summarize(run)["num_completed"] == 0


# ------------------------------------------------------------------ HTTP against a local SSE server
class FakeOpenAI(BaseHTTPRequestHandler):
    """POST /v1/completions (streaming, one chunk per token), GET /v1/models and /metrics."""
    lock = threading.Lock()
    state = {"in_flight": 0, "max_in_flight": 0, "bodies": [], "drafts": 0, "accepted": 0}

    def log_message(self, *args):
        pass

    def _send(self, status, body, ctype="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
        if self.path == "/metrics":
            s = self.state
            return self._send(200, "# TYPE x counter\n"
                                   f'fake:spec_decode_num_drafts_total{{replica="0"}} {s["drafts"]}\n'
                                   f'fake:spec_decode_num_draft_tokens_total{{replica="0"}} {2 * s["drafts"]}\n'
                                   f'fake:spec_decode_num_accepted_tokens_total{{replica="0"}} {s["accepted"]}\n'
                                   f'fake:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {s["accepted"]}\n',
                              "text/plain")
        self._send(404, "{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.state["bodies"].append(body)
            self.state["in_flight"] += 1
            self.state["max_in_flight"] = max(self.state["max_in_flight"], self.state["in_flight"])
        done = False

        def leave():                                # before the last bytes: a client answered may send again
            nonlocal done
            with self.lock:
                if not done:
                    done = True
                    self.state["in_flight"] -= 1
        try:
            if body["prompt"] == "refuse me":
                leave()
                return self._send(400, json.dumps({"error": {"message": "bad prompt"}}))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            for i in range(n):
                time.sleep(0.01)
                chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": "length" if i == n - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            with self.lock:
                self.state["drafts"] += n
                self.state["accepted"] += n // 2
            leave()
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        finally:
            leave()


@pytest.fixture
def fake_server():
    FakeOpenAI.state.update(in_flight=0, max_in_flight=0, bodies=[], drafts=0, accepted=0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_http_mode_streams_against_an_openai_compatible_server(fake_server, tmp_path, capsys):
    rc = bench(["--url", fake_server, "--model", str(tmp_path / "no-model"), "--concurrency", "2",
                "--num-prompts", "4", "--max-tokens", "5", "--timeout-s", "30", "--no-plot", "--warmup-requests", "0",
                "--results-dir", str(tmp_path)])
    assert rc == 0
    [r] = only_json(tmp_path)["results"]
    assert r["system"] == "http" and r["num_completed"] == 4 and r["num_output_tokens"] == 20
    assert r["num_prompt_tokens"] == 4 * 7                     # from usage
    assert r["tokens_per_chunk"] == 1.0 and r["itl_ms"]["p99"] >= 5         # the server sleeps 10 ms a token
    assert r["spec"]["acceptance_rate"] == pytest.approx(8 / 40) and r["spec"]["acceptance_length"] == pytest.approx(1.4)
    state = FakeOpenAI.state
    assert state["max_in_flight"] == 2
    body = state["bodies"][0]
    assert body["model"] == "fake-model" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5


def test_client_processes_split_a_load_and_keep_its_concurrency(fake_server, tmp_path):
    """--client-processes 2 at C=4: every request answered once, in order, 4 in flight at most
    and at some point all 4 (two per process), and each run records the client's CPU share."""
    rc = bench(["--url", fake_server, "--model", str(tmp_path / "no-model"), "--concurrency", "4",
                "--num-prompts", "8", "--max-tokens", "5", "--timeout-s", "30", "--no-plot", "--warmup-requests", "0",
                "--client-processes", "2", "--results-dir", str(tmp_path)])
    assert rc == 0
    [r] = only_json(tmp_path)["results"]
    assert r["num_completed"] == 8 and r["num_output_tokens"] == 40 and r["extra"]["client_processes"] == 2
    assert 0 < r["extra"]["client_cpu_share"] < 1
    assert FakeOpenAI.state["max_in_flight"] == 4 and len(FakeOpenAI.state["bodies"]) == 8
    assert r["ttft_ms"]["p50"] < 1000, "the processes started before the run's clock"
    FakeOpenAI.state.update(max_in_flight=0, bodies=[])
    rc = bench(["--url", fake_server, "--model", str(tmp_path / "no-model"), "--concurrency", "1",
                "--num-prompts", "4", "--max-tokens", "3", "--timeout-s", "30", "--no-plot", "--warmup-requests", "0",
                "--client-processes", "3", "--results-dir", str(tmp_path / "c1")])
    [r] = only_json(tmp_path / "c1")["results"]
    assert r["num_completed"] == 4 and r["extra"]["client_processes"] == 1
    assert FakeOpenAI.state["max_in_flight"] == 1, "C=1 stays one request in flight, whatever the processes"


def test_http_mode_records_refused_requests(fake_server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nrefuse me\n")
    rc = bench(["--url", fake_server, "--served-model", "fake-model", "--prompts-file", str(prompts),
                "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "3", "--no-ignore-eos",
                "--no-plot", "--results-dir", str(tmp_path / "out")])
    assert rc == 0
    [r] = only_json(tmp_path / "out")["results"]
    assert (r["num_completed"], r["num_failed"]) == (2, 2) and "2 of 4 requests failed" in r["error"]
    assert any("bad prompt" in e or "400" in e for e in r["request_errors"])
    assert "ignore_eos" not in FakeOpenAI.state["bodies"][0]


def test_serving_overhead_runs_through_bench_with_its_own_options(monkeypatch):
    from mtpserve.cluster.bench import serving_overhead
    seen = {}
    monkeypatch.setattr(serving_overhead, "main", lambda argv, prog=None: seen.update(argv=argv, prog=prog) or 0)
    assert bench(["--model", "M", "--serving-overhead", "--requests", "3", "--model", "N", "--port", "9"]) == 0
    assert seen == {"argv": ["--model", "M", "--requests", "3", "--model", "N", "--port", "9"],
                    "prog": "mtpserve bench --serving-overhead"}     # the bench's --model first: later ones win


def test_anchor_child_reports_an_og_without_cuda(tiny_paged_export):
    og = pytest.importorskip("onnxruntime_genai")
    if og.is_cuda_available():
        pytest.skip("this onnxruntime-genai has CUDA")
    sweep = bench_anchor.AnchorSweep(str(tiny_paged_export), (0,), (Load(concurrency=1),), 2, num_warmup_requests=0)
    runs, note = bench_anchor.run_anchor(sweep, Workload([[1, 2, 3]], None), "cuda", log=lambda m: None)
    assert runs == [] and "no CUDA support" in note


def test_replica_count_zero_is_the_in_process_baseline_of_what_serving_adds():
    from mtpserve.cluster.bench import replicas
    assert replicas.parse_replicas("0,1", "cpu", 2) == (0, 1)
    with pytest.raises(ValueError, match="counts >= 1"):
        replicas.parse_replicas("0", "cpu", 2)

    def summary(n, ttft, itl, tps, system="1 replica, direct ingress"):
        return {"system": system, "extra": {"num_replicas": n}, "load": "C=1", "concurrency": 1, "num_completed": 4,
                "output_token_throughput": tps, "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
                "itl_ms": {"p50": itl, "p99": 3 * itl}}
    rows = replicas.http_overhead([summary(0, 10.0, 2.0, 400.0), summary(1, 13.5, 2.5, 300.0)])
    assert len(rows) == 1
    r = rows[0]
    assert (r["ttft_p50_added_ms"], r["ttft_p99_added_ms"], r["itl_p50_added_ms"], r["itl_p99_added_ms"]) == \
        (3.5, 7.0, 0.5, 1.5)
    assert r["throughput_ratio"] == 0.75
    assert replicas.scaling([summary(0, 10.0, 2.0, 400.0), summary(1, 13.5, 2.5, 300.0)]) == []
    assert "+3.50" in replicas.format_http_overhead(rows)
    # one row per HTTP configuration compared in the run (Serve's direct ingress, API servers)
    rows = replicas.http_overhead([summary(0, 10.0, 2.0, 400.0), summary(1, 13.5, 2.5, 300.0),
                                   summary(1, 11.0, 2.1, 380.0, "1 replica, 2 API servers")])
    assert [(r["system"], r["ttft_p50_added_ms"]) for r in rows] == [("1 replica, direct ingress", 3.5),
                                                                      ("1 replica, 2 API servers", 1.0)]
    assert "2 API servers" in replicas.format_http_overhead(rows)
    # open-loop loads (--request-rate) pair up by their rate, as closed loops by concurrency
    rated = [{**summary(0, 10.0, 2.0, 400.0), "load": "4 req/s", "concurrency": None},
             {**summary(1, 12.0, 2.0, 400.0), "load": "4 req/s", "concurrency": None}]
    rows = replicas.http_overhead(rated + [summary(0, 10.0, 2.0, 400.0), summary(1, 13.5, 2.5, 300.0)])
    assert sorted((r["load"], r["ttft_p50_added_ms"]) for r in rows) == [("4 req/s", 2.0), ("C=1", 3.5)]


def test_grammar_cost_reports_valid_answers_and_acceptance_on_and_off(model_dir, tmp_path):
    """`python -m mtpserve.cluster.bench.grammar cost`: every constrained answer is JSON, the
    unconstrained run makes as many tokens, and acceptance is reported both ways for K > 0."""
    from mtpserve.cluster.bench import grammar as bench_grammar
    assert bench_grammar.main(["cost", "--model", str(model_dir), "--out", str(tmp_path), "--requests", "4",
                               "--concurrency", "1,4", "--draft-tokens", "0,2", "--repeats", "1",
                               "--max-tokens", "80", "--num-threads", "1"]) == 0
    rows = only_json(tmp_path)["results"]
    assert [(r["draft_tokens"], r["concurrency"]) for r in rows] == [(0, 1), (0, 4), (2, 1), (2, 4)]
    for r in rows:
        assert r["valid_json"] == 4 and r["output_tokens"] > 4 and r["grammar_host_us_per_token"] > 0
        assert (r["acceptance_on"] is None) == (r["draft_tokens"] == 0) == (r["acceptance_off"] is None)
        assert r["draft_tokens"] == 0 or 0 < r["acceptance_on"] <= 1


def test_an_http_runs_server_side_comes_from_two_metrics_scrapes():
    """Steps and the server's TTFT / queue / prefill histograms between two scrapes of /metrics
    (two replicas summed): the means and counts of the run's requests alone."""
    from mtpserve.actors.engine_loop import LoopSnapshot
    from mtpserve.actors.metrics import MetricsRecorder, render_metrics
    from mtpserve.cluster.bench.http_driver import _server_delta, parse_metrics
    a, b = MetricsRecorder(), MetricsRecorder()
    a.observe_ttft(0.5)
    a.observe_admission(0.2, 0.2)                     # before the run: not the run's

    def scrape(steps):
        loop = LoopSnapshot(num_steps=steps, num_overlapped_steps=steps // 2)
        return parse_metrics(render_metrics("m", {"a": (a.snapshot(), loop), "b": (b.snapshot(), loop)}).decode())
    before = scrape(10)
    for rec, ttft in ((a, 0.004), (b, 0.008)):
        rec.observe_ttft(ttft)
        rec.observe_admission(0.001, 0.002)
    server = _server_delta(before, scrape(30))
    assert server["num_steps"] == 40 and server["num_overlapped_steps"] == 20
    assert server["ttft_ms"]["count"] == 2 and server["ttft_ms"]["mean"] == pytest.approx(6.0)
    assert server["ttft_ms"]["p50_at_most"] == 5.0 and server["ttft_ms"]["p99_at_most"] == 10.0
    assert server["queue_ms"]["mean"] == pytest.approx(1.0) and server["prefill_ms"]["mean"] == pytest.approx(2.0)
