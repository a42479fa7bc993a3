"""The prefix cache on the real bundled model: a request that starts from a cached prefix (shared KV
blocks, a recurrent-state snapshot, the MTP head caught up) produces exactly the tokens it
produces with the cache off, at K=0 and with MTP, in every way a prefix can be reused or lost."""
from __future__ import annotations

import dataclasses

import pytest

from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams

from test_engine import PROMPTS

SYSTEM = ("# Project utilities: configuration loading, path handling and logging set-up.\n"
          "import os\nimport sys\nimport json\nimport logging\n\nlogger = logging.getLogger(__name__)\n\n")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def engine_with(model_dir, cache: bool, k=0, num_blocks=512, budget=64, rows=16, interval=16, host_gib=4.0,
                snapshot_gib=1.0, host_policy="all", snapshots="all", prompt_graphs=False):
    return Engine(EngineConfig(str(model_dir), num_threads=2, prompt_graphs=prompt_graphs,
                               cache=CacheConfig(num_blocks=num_blocks, max_resident_requests=rows,
                                                 prefix_cache=cache, snapshot_interval=interval,
                                                 prefix_host_gib=host_gib, prefix_snapshot_gib=snapshot_gib,
                                                 prefix_host_policy=host_policy, prefix_snapshots=snapshots),
                               scheduler=SchedulerConfig(max_tokens_per_step=budget, max_requests_per_step=rows),
                               spec=SpecConfig(draft_tokens=k)))


def serve(engine, rounds, params=GREEDY, after_step=None):
    """Each round's prompts submitted together and run to the end, rounds one after another;
    integrity checked after every step. Returns (outputs by round, cached tokens by round)."""
    outputs, cached = [], []
    for n, prompts in enumerate(rounds):
        reqs = [engine.add_request(f"t{n}-{i}", p, params) for i, p in enumerate(prompts)]
        got = {r.request_id: [] for r in reqs}
        while engine.has_work:
            for ev in engine.step():
                got[ev.request_id].extend(ev.token_ids)
            engine.check_integrity()
            if after_step is not None:
                after_step(engine)
        outputs.append([got[r.request_id] for r in reqs])
        cached.append([r.num_cached_tokens for r in reqs])
    assert engine.is_idle_and_empty()
    return outputs, cached


def reference(model_dir, rounds, k=0, **kw):
    return serve(engine_with(model_dir, False, k, **kw), rounds)[0]


@pytest.mark.parametrize("k", [0, 2])
def test_an_exact_repeat_hits_and_gives_the_same_tokens(model_dir, k):
    rounds = [[SYSTEM + PROMPTS[2]], [SYSTEM + PROMPTS[2]], [SYSTEM + PROMPTS[2]]]
    engine = engine_with(model_dir, True, k)
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds, k)
    n = len(engine.tokenizer.encode(SYSTEM + PROMPTS[2]))
    assert cached[0] == [0] and cached[1][0] == cached[2][0] == (n - 1) // 16 * 16 > 0
    assert engine.prefix_cache.stats.num_requests_hit == 2


def test_with_mtp_every_full_head_block_is_kept_for_the_next_hit(model_dir):
    """Head block j (the MTP head's KV) is entered under main entry j + 1 once both are full, so
    a later hit shares the head's blocks too and its head catches up on one block, not its
    prompt (a head block left out is a stale one for the hit: its drafts, not its tokens, go
    wrong). Checked after a request with 9 blocks of prompt and output."""
    from mtpserve.engine.prefix_cache import chain_digests
    engine = engine_with(model_dir, True, 2)
    prompt = engine.tokenizer.encode(SYSTEM + PROMPTS[2])
    out, _ = serve(engine, [[prompt]], dataclasses.replace(GREEDY, max_tokens=9 * 16 - len(prompt) + 5))
    tokens = prompt + out[0][0]
    digests = chain_digests(tokens[:len(tokens) - 1], 16, [])      # the blocks the request committed
    entries = [engine.prefix_cache.entries.get(d) for d in digests]
    assert all(e is not None for e in entries), "a full main block was not entered"
    missing = [j for j, e in enumerate(entries[1:]) if e.head_block is None]
    assert not missing, f"head blocks {missing} (of {len(entries) - 1}) were not kept"


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_a_shared_system_prompt_with_different_suffixes(model_dir, k):
    """The first request's snapshots every block let the others start at the last shared one."""
    rounds = [[SYSTEM + PROMPTS[0]], [SYSTEM + p for p in PROMPTS[1:8]]]
    engine = engine_with(model_dir, True, k)
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds, k)
    shared = len(engine.tokenizer.encode(SYSTEM)) // 16 * 16
    assert all(c >= shared - 16 for c in cached[1]), cached
    if k:
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("k", [0, 2])
def test_prefix_hits_through_varlen_prompt_bindings_keep_the_tokens(model_dir, k):
    """``prompt_graphs``: a hit's rows start past its cached prefix (a restored snapshot in its
    state row, shared KV blocks) and go through a varlen binding like any prompt step (run
    eagerly on the CPU, as a captured one replays on CUDA): the tokens are the cache off's."""
    rounds = [[SYSTEM + PROMPTS[0]], [SYSTEM + p for p in PROMPTS[1:8]], [SYSTEM + PROMPTS[0]]]
    engine = engine_with(model_dir, True, k, prompt_graphs=True)
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds, k)
    assert all(c > 0 for c in cached[1] + cached[2]), cached
    assert engine.prompt_graphs.num_replays > 0 and engine.prompt_graphs.num_eager == 0


@pytest.mark.parametrize("k", [0, 3])
def test_a_second_turn_extends_the_first_including_its_generated_tokens(model_dir, k):
    engine = engine_with(model_dir, True, k)
    first, _ = serve(engine, [[SYSTEM + PROMPTS[3]]])
    ids = engine.tokenizer.encode(SYSTEM + PROMPTS[3]) + first[0][0] + engine.tokenizer.encode("\n# next\n")
    out, cached = serve(engine, [[ids]])
    ref_engine = engine_with(model_dir, False, k)
    assert serve(ref_engine, [[SYSTEM + PROMPTS[3]]])[0] == first
    assert out == serve(ref_engine, [[ids]])[0]
    assert cached[0][0] >= len(engine.tokenizer.encode(SYSTEM + PROMPTS[3])) - 16


@pytest.mark.parametrize("k", [0, 2])
def test_concurrent_requests_share_a_prefix_still_being_prefilled(model_dir, k):
    """Admitted while the first is mid-prompt (a 24-token budget), the others find what it has
    committed so far, or nothing: never a block that is not written yet."""
    rounds = [[SYSTEM + p for p in PROMPTS[:6]]]
    out, cached = serve(engine_with(model_dir, True, k, budget=24), rounds)
    assert out == reference(model_dir, rounds, k, budget=24)


@pytest.mark.parametrize("k", [0, 2])
def test_eviction_under_memory_pressure_and_preemption(model_dir, k):
    """A pool too small for the working set: cached blocks are evicted (entries and snapshots
    with them) and requests preempted; outputs stay exact and the pools consistent."""
    rounds = [[SYSTEM + p for p in PROMPTS[:4]], [p + SYSTEM for p in PROMPTS[4:10]], [SYSTEM + p for p in PROMPTS[:4]]]
    engine = engine_with(model_dir, True, k, num_blocks=40, rows=6)
    out, _ = serve(engine, rounds)
    assert out == reference(model_dir, rounds, k, num_blocks=40, rows=6)
    assert engine.prefix_cache.stats.num_evicted_entries > 0


@pytest.mark.parametrize("k", [0, 2])
def test_abort_of_the_request_that_created_an_entry(model_dir, k):
    engine = engine_with(model_dir, True, k, budget=32)
    first = engine.add_request("creator", SYSTEM + PROMPTS[5], GREEDY)
    for _ in range(3):
        engine.step()
    assert 0 < first.num_computed < len(first.token_ids)
    engine.abort("creator")
    engine.check_integrity()
    rounds = [[SYSTEM + PROMPTS[5]], [SYSTEM + PROMPTS[6]]]
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds, k, budget=32)
    assert cached[0][0] > 0, "what the aborted request committed is reused"


@pytest.mark.parametrize("k", [0, 2, 4])
def test_poisoning_a_then_b_then_a(model_dir, k):
    """vLLM's failure: A, then B sharing A's prefix with a different continuation, then A again.
    The third request must give A's tokens, not B's state."""
    a, b = SYSTEM + PROMPTS[7], SYSTEM + PROMPTS[8]
    rounds = [[a], [b], [a]]
    engine = engine_with(model_dir, True, k)
    out, cached = serve(engine, rounds)
    ref = reference(model_dir, rounds, k)
    assert out == ref and out[0] == out[2]
    assert cached[1][0] > 0, "B starts from A's shared prefix"
    assert cached[2][0] == (len(engine.tokenizer.encode(a)) - 1) // 16 * 16, "A again: all of A's own prompt"


def test_sampled_requests_from_a_hit_are_seeded_like_cold_ones(model_dir):
    """A sampled request with a seed draws the same tokens whether it starts from the cache or not
    (the hit only skips computing the prefix; the target distribution per token is unchanged)."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True)
    rounds = [[SYSTEM + PROMPTS[9]], [SYSTEM + PROMPTS[9]]]
    out, cached = serve(engine_with(model_dir, True, 2), rounds, params)
    cold, _ = serve(engine_with(model_dir, False, 2), rounds, params)
    assert cached[1][0] > 0 and out == cold


@pytest.mark.parametrize("k", [0, 2])
def test_a_prefix_shared_twice_gets_a_snapshot_where_the_prompts_diverge(model_dir, k):
    """Snapshots every 256 tokens only: the second request matches the system prompt's blocks
    but finds no snapshot there, so it takes one at the end of the match; the third starts there."""
    rounds = [[SYSTEM + PROMPTS[2]], [SYSTEM + PROMPTS[13]], [SYSTEM + PROMPTS[15]]]
    engine = engine_with(model_dir, True, k, interval=256)
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds, k)
    shared = len(engine.tokenizer.encode(SYSTEM)) // 16 * 16
    assert cached[0] == cached[1] == [0]
    assert cached[2][0] >= shared - 16 > 0


@pytest.mark.parametrize("k", [0, 2])
def test_entries_the_device_evicts_come_back_from_the_host_tier(model_dir, k):
    """A pool too small to keep the first round's prefixes: they go to host memory (msgpack) and
    the third round starts from them again, restored onto the device, with the cache-off tokens;
    with the host tier off the same third round finds much less."""
    rounds = [[SYSTEM + p for p in PROMPTS[:3]], [p + SYSTEM * 2 for p in PROMPTS[10:14]], [SYSTEM + p for p in PROMPTS[:3]]]
    engine = engine_with(model_dir, True, k, num_blocks=32, rows=6)
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds, k, num_blocks=32, rows=6)
    stats = engine.prefix_cache.stats
    assert stats.num_offloaded > 0 and stats.num_restored > 0
    no_tier = engine_with(model_dir, True, k, num_blocks=32, rows=6, host_gib=0)
    out_no_tier, cached_no_tier = serve(no_tier, rounds)
    assert out_no_tier == out
    assert sum(cached[2]) > sum(cached_no_tier[2])


@pytest.mark.parametrize("k", [0, 2])
def test_snapshots_reused_a_prompt_seen_once_costs_no_chunk_and_a_repeat_hits_the_third_time(model_dir, k):
    """prefix_snapshots=reused: a prompt seen once gets no snapshot (and no chunk cut short for
    one); the second to share its prefix snapshots where the match ends, the third starts there; a
    shared system prompt still gets its snapshot where two prompts part. Tokens as the cache off."""
    prompt = SYSTEM * 2 + PROMPTS[4]
    n = len(Engine(EngineConfig(str(model_dir))).tokenizer.encode(prompt))
    rounds = [[prompt], [prompt], [prompt], [SYSTEM + PROMPTS[5]], [SYSTEM + PROMPTS[6]], [SYSTEM + PROMPTS[7]]]
    engine = engine_with(model_dir, True, k, budget=512, interval=512, snapshots="reused")
    steps = []
    out, cached = serve(engine, rounds, after_step=lambda e: steps.append(e.last_step.num_main_tokens))
    assert out == reference(model_dir, rounds, k)
    assert [c[0] for c in cached[:3]] == [0, 0, (n - 1) // 16 * 16]
    assert cached[5][0] >= len(engine.tokenizer.encode(SYSTEM)) // 16 * 16 - 16 > 0   # parted at the system prompt
    stats = engine.prefix_cache.stats
    assert stats.num_snapshots_taken == 2 + (cached[4][0] == 0)   # round 2, round 4 or 5 at the parting
    # the first prompt went in one chunk (no cut at its last block); with "all" it is cut there
    every = engine_with(model_dir, True, k, budget=512, interval=512)
    every_steps = []
    serve(every, rounds[:1], after_step=lambda e: every_steps.append(e.last_step.num_main_tokens))
    assert steps[0] >= n and every_steps[0] == (n - 1) // 16 * 16


@pytest.mark.parametrize("k", [0, 2])
def test_snapshots_reused_a_session_turn_is_snapshotted_so_the_next_turn_hits(model_dir, k):
    """Under the default policy a request that a later one continues (a session's turn:
    ``continues``) still snapshots its prompt's boundaries, so the next turn, which extends the
    first turn's prompt and answer, starts from the cache; without it the next turn misses.
    Tokens as the cache off, both turns."""
    first = SYSTEM * 2 + PROMPTS[4]
    for continues in (True, False):
        engine = engine_with(model_dir, True, k, budget=512, interval=512, snapshots="reused")
        turns, outputs, cached = [engine.tokenizer.encode(first)], [], []
        n = len(turns[0])
        for turn in range(2):
            req = engine.add_request(f"turn{turn}", turns[-1], GREEDY, continues=continues)
            got = []
            while engine.has_work:
                for ev in engine.step():
                    got.extend(ev.token_ids)
                engine.check_integrity()
            outputs.append(got)
            cached.append(req.num_cached_tokens)
            turns.append(turns[-1] + got + engine.tokenizer.encode("\n# next:\n"))
        assert outputs == [o[0] for o in reference(model_dir, [[turns[0]], [turns[1]]], k)]
        assert cached == ([0, (n - 1) // 16 * 16] if continues else [0, 0])
        assert engine.is_idle_and_empty()


def test_by_default_the_host_tier_takes_only_prefixes_met_again(model_dir):
    """The default policy (reused): prompts seen once are dropped when the device evicts them (no
    device-to-host copies for one-off traffic); a prefix a later lookup met again is offloaded,
    and a third request still starts from it after the device let it go."""
    one_off = [[p + SYSTEM * 6] for p in PROMPTS[3:7]]        # each seen once, evicted by the next
    engine = engine_with(model_dir, True, 0, num_blocks=32, rows=6, host_policy="reused")
    out, _ = serve(engine, one_off)
    assert out == reference(model_dir, one_off, 0, num_blocks=32, rows=6)
    assert engine.prefix_cache.stats.num_evicted_entries > 0 and engine.prefix_cache.stats.num_offloaded == 0
    shared = [[SYSTEM + PROMPTS[0]], [SYSTEM + PROMPTS[1]]]   # the second one meets the first's prefix
    churn = [[p + SYSTEM * 6] for p in PROMPTS[10:13]]        # then the device evicts it
    rounds = shared + churn + [[SYSTEM + PROMPTS[2]]]
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds, 0, num_blocks=32, rows=6)
    assert engine.prefix_cache.stats.num_offloaded > 0 and engine.prefix_cache.stats.num_restored > 0
    assert cached[-1][0] >= len(engine.tokenizer.encode(SYSTEM)) // 16 * 16 - 16 > 0


def test_snapshots_that_lose_their_slot_come_back_from_the_host_tier(model_dir):
    """Room for two snapshots only: older ones are offloaded and restored when a lookup needs them."""
    prompts = [SYSTEM + PROMPTS[i] * 4 for i in range(5)]     # each ends past the system prompt's blocks
    rounds = [[p] for p in prompts] + [[prompts[0]]]
    row_bytes = engine_with(model_dir, False, 2).state_bank.spec.bytes_per_row(1)
    engine_small = engine_with(model_dir, True, 2, snapshot_gib=2 * row_bytes / 2**30)
    assert len(engine_small.state_bank.snapshot_conv) == 2
    out, cached = serve(engine_small, rounds)
    assert out == reference(model_dir, rounds, 2)
    assert engine_small.prefix_cache.stats.num_restored > 0
    n = len(engine_small.tokenizer.encode(prompts[0]))
    assert cached[-1][0] == (n - 1) // 16 * 16 > len(engine_small.tokenizer.encode(SYSTEM))


def test_a_full_snapshot_budget_gives_up_the_least_recently_used_snapshot(model_dir):
    """Two snapshot slots, no host tier, prompts of one block boundary each: A, B, A again (a
    hit, which makes A's snapshot the newest used), then C needs a slot and takes B's, the one
    least recently used. A hits once more; B, asked again, starts cold."""
    a, b, c = ([base + t for t in range(24)] for base in (100, 200, 300))
    rounds = [[a], [b], [a], [c], [a], [b]]
    row_bytes = engine_with(model_dir, False).state_bank.spec.bytes_per_row(1)
    engine = engine_with(model_dir, True, snapshot_gib=2 * row_bytes / 2**30, host_gib=0.0)
    assert len(engine.state_bank.snapshot_conv) == 2
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds)
    assert [x[0] for x in cached] == [0, 0, 16, 0, 16, 0]


def test_a_hit_restores_one_snapshot_not_every_snapshot_on_its_path(model_dir):
    """A long prompt leaves a snapshot every 16 tokens, more than the two slots hold, so most
    go to the host tier. A repeat starts from the deepest one: the shallower ones on its path
    stay on the host (bringing each back evicts another: a repeat would cost a copy of every
    snapshot of the prompt both ways, seconds per request for a long prompt on a large model)."""
    prompt = SYSTEM * 3 + PROMPTS[0]
    rounds = [[prompt]] * 4
    row_bytes = engine_with(model_dir, False).state_bank.spec.bytes_per_row(1)
    engine = engine_with(model_dir, True, snapshot_gib=2 * row_bytes / 2**30)
    out, cached = serve(engine, rounds)
    assert out == reference(model_dir, rounds)
    stats = engine.prefix_cache.stats
    assert stats.num_snapshots_taken > 8 and stats.num_offloaded >= stats.num_snapshots_taken - 2
    assert stats.num_requests_hit == 3 and all(c[0] > 0 for c in cached[1:])
    assert stats.num_restored <= stats.num_requests_hit


def test_a_packed_array_and_host_record_round_trip_exactly():
    import numpy as np

    from mtpserve.engine.prefix_cache import pack_array, pack_record, unpack_array, unpack_record
    for arr in (np.arange(24, dtype=np.float16).reshape(2, 3, 4), np.random.default_rng(0).standard_normal((5, 7)),
                np.zeros((0, 3), np.int32)):
        back = unpack_array(pack_array(arr))
        assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)
    rng = np.random.default_rng(1)
    record = {"kv": [rng.standard_normal((16, 2, 8)).astype(np.float16) for _ in range(3)],
              "snapshot": (rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 4, 4)), 48),
              "hidden": rng.standard_normal((16, 64)).astype(np.float32)}
    back = unpack_record(pack_record(record))
    assert back.keys() == record.keys() and back["snapshot"][2] == 48
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(back["kv"], record["kv"]))
    assert all(np.array_equal(a, b) for a, b in zip(back["snapshot"][:2], record["snapshot"][:2]))
    assert np.array_equal(back["hidden"], record["hidden"])


def test_a_snapshot_budget_too_small_for_one_snapshot_is_refused(model_dir):
    with pytest.raises(ValueError, match="holds no state snapshot"):
        engine_with(model_dir, True, snapshot_gib=0)


def test_the_routing_index_names_cached_prefixes_within_the_routed_depth_newest_first(model_dir):
    """What a replica tells routers: its entries' chain digests (cut to ROUTING_DIGEST_BYTES) within
    the first ROUTED_PREFIX_TOKENS tokens, newest first, bounded; evicted entries leave it."""
    from mtpserve.engine.prefix_cache import ROUTED_PREFIX_TOKENS, ROUTING_DIGEST_BYTES, chain_digests
    engine = engine_with(model_dir, cache=True, num_blocks=160)
    cache, bs, n = engine.prefix_cache, engine.manifest.block_size, ROUTING_DIGEST_BYTES

    def digests(ids):
        return [d[:n] for d in chain_digests(ids, bs, [])]

    def index(limit=4096):
        blob = cache.routing_index(limit)
        return [blob[i:i + n] for i in range(0, len(blob), n)]
    long_a = [7 + (i * 13) % 400 for i in range(1200)]          # 75 blocks, deeper than routing looks
    short_b = [11 + (i * 7) % 300 for i in range(100)]
    serve(engine, [[long_a]], SamplingParams(temperature=0, max_tokens=1))
    version = cache.routing_version
    assert index() == digests(long_a)[:ROUTED_PREFIX_TOKENS // bs][::-1]
    serve(engine, [[short_b]], SamplingParams(temperature=0, max_tokens=1))
    assert cache.routing_version > version
    assert index()[:6] == digests(short_b)[::-1] and len(index()) == ROUTED_PREFIX_TOKENS // bs + 6
    assert index(limit=3) == digests(short_b)[::-1][:3]
    # a's blocks are reclaimed for two more long prompts: its digests leave the index, b's stay
    serve(engine, [[[5 + (i * 11) % 350 for i in range(1200)]], [[9 + (i * 3) % 380 for i in range(1200)]]],
          SamplingParams(temperature=0, max_tokens=1))
    assert not set(digests(long_a)) & set(index())
    assert set(digests(short_b)) <= set(index())
    engine.check_integrity()


@pytest.mark.parametrize("k", [0, 2])
def test_a_prefix_moved_to_another_engine_gives_it_the_hit_and_the_same_tokens(model_dir, k):
    """``export_prefix`` on the engine that served a prompt, ``import_prefix`` on another (the
    msgpack records a replica sends a peer): the second engine starts the next turn from the
    moved prefix, as the first would have, with the cache-off tokens; a record of another shape
    is refused."""
    import msgpack
    import numpy as np

    from mtpserve.engine.prefix_cache import pack_record, unpack_record
    first = SYSTEM * 2 + PROMPTS[4]
    source = engine_with(model_dir, True, k, budget=512, interval=512, snapshots="reused")
    ids = source.tokenizer.encode(first)
    req = source.add_request("turn0", ids, GREEDY, continues=True)
    got = []
    while source.has_work:
        for ev in source.step():
            got.extend(ev.token_ids)
    turn2 = ids + got + source.tokenizer.encode("\n# next:\n")
    records = source.export_prefix(turn2)
    boundary = (len(ids) - 1) // 16 * 16
    assert len(records) == boundary // 16 and req.num_cached_tokens == 0
    target = engine_with(model_dir, True, k, budget=512, interval=512, snapshots="reused")
    assert target.export_prefix(turn2) == []
    assert target.import_prefix(records) == boundary
    moved = target.add_request("turn1", turn2, GREEDY)
    out = []
    while target.has_work:
        for ev in target.step():
            out.extend(ev.token_ids)
        target.check_integrity()
    assert moved.num_cached_tokens == boundary > 0
    assert out == reference(model_dir, [[turn2]], k)[0][0]
    assert target.prefix_cache.stats.num_restored > 0 and target.is_idle_and_empty()
    digest, blob = records[0]
    record = unpack_record(blob)
    record["kv"] = [a[:, :1] for a in record["kv"]]
    other = engine_with(model_dir, True, k)
    with pytest.raises(ValueError, match="do not fit"):
        other.import_prefix([(digest, pack_record(record))])
    with_snapshot = next(unpack_record(b) for _, b in records if "snapshot" in unpack_record(b))
    malformed = [[(b"x", b"y")], [("not bytes", 5)], [(digest,)], [(digest, msgpack.packb({"kv": 5}))],
                 [(digest, pack_record({**with_snapshot, "hidden": with_snapshot["snapshot"][0]}))]]
    conv, recurrent, length = with_snapshot["snapshot"]
    malformed += [[(digest, pack_record({**with_snapshot, "snapshot": (conv, recurrent, float(length))}))],
                  [(digest, pack_record({**with_snapshot, "snapshot": (conv, recurrent, length + 5)}))]]
    if k:                                           # the hidden rows of a block of this model: MTP on only
        hidden = with_snapshot["hidden"]
        malformed += [[(digest, pack_record({**with_snapshot, "hidden": hidden[:3]}))],
                      [(digest, pack_record({**with_snapshot, "hidden": np.zeros((16, hidden.shape[1] + 8), hidden.dtype)}))],
                      [(digest, pack_record({**with_snapshot, "hidden": hidden.astype(np.float64)}))],
                      [(digest, pack_record({p: v for p, v in with_snapshot.items() if p != "hidden"}))]]
    for bad in malformed:                           # a clear ValueError, never the unpacking's own error
        with pytest.raises(ValueError, match="prefix record"):
            other.import_prefix(bad)
    other.check_integrity()
