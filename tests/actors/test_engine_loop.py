"""The engine's owner thread, without Ray: bursts queue, disconnects free, output is the engine's."""
import asyncio
import gc
import os
import threading
import time

import pytest

from mtpserve.actors.engine_loop import EngineFailed, EngineLoop, Overloaded, merge_streams
from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.request import FinishReason
from mtpserve.engine.sampler import SamplingParams

PROMPTS = ["def add(a, b):", "import os\nimport", "class Stack:\n    def"]


@pytest.fixture
def make_loop(model_dir):
    loops = []

    def make(num_blocks=64, rows=8, max_pending=1024, adaptive=True):
        config = EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(num_blocks, rows),
                              spec=SpecConfig("auto" if adaptive else 4))
        loop = EngineLoop(Engine(config), max_pending).start()
        loops.append(loop)
        return loop
    yield make
    for loop in loops:
        loop.stop()


async def _collect(loop, rid, ids, params):
    tokens, last = [], None
    async for event in loop.submit(rid, ids, params):
        tokens += event.token_ids
        last = event
    return tokens, last


def _status(loop) -> dict:
    """Checked on the owner thread, between steps: integrity, emptiness, ledger peaks."""
    async def check():
        def inspect(engine):
            engine.check_integrity()
            loop.ledger.check_integrity()
            return {"idle_and_empty": engine.is_idle_and_empty(), "max_pending_seen": loop._max_pending_seen,
                    "peak_blocks": loop.ledger.peak_reserved_blocks, "peak_rows": loop.ledger.peak_reserved_rows,
                    "reserved_blocks": loop.ledger.num_reserved_blocks, "pending": len(loop._pending)}
        return await loop.call(inspect)
    return asyncio.run(check())


def test_a_burst_of_64_queues_and_never_over_reserves(make_loop):
    loop = make_loop(num_blocks=40, rows=8)
    preempted = []
    scheduler = loop.engine.scheduler
    original = scheduler.preempt
    scheduler.preempt = lambda req, plan: (preempted.append(req.request_id), original(req, plan))
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True)
    ids = loop.engine.tokenizer.encode("for i in range(")

    async def burst():
        return await asyncio.gather(*[_collect(loop, f"b{i}", ids, params) for i in range(64)])
    results = asyncio.run(burst())
    assert all(len(t) == 40 and e.finish_reason is FinishReason.LENGTH for t, e in results), "none fail"
    status = _status(loop)
    assert status["max_pending_seen"] > 0, "some requests had to wait"
    assert status["peak_blocks"] <= loop.ledger.num_blocks_granted == loop.num_usable_blocks
    assert status["peak_rows"] <= 8
    assert preempted == [], "the engine never had to preempt"
    assert status["idle_and_empty"]


def test_closing_a_stream_aborts_running_and_waiting_requests(make_loop):
    loop = make_loop(rows=1)
    ids = loop.engine.tokenizer.encode(PROMPTS[0])
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def scenario():
        running = loop.submit("run", ids, long)
        waiting = loop.submit("wait", ids, long)           # one state row: this one queues
        reader = merge_streams([running])
        for _ in range(3):
            await reader.__anext__()
        await reader.aclose()                              # client went away mid-stream
        waiting.cancel()
    asyncio.run(scenario())
    status = _status(loop)               # the inbox is FIFO: both aborts were applied before this
    assert status["pending"] == 0 and status["reserved_blocks"] == 0
    assert status["idle_and_empty"], "blocks and the state row are back"


def test_greedy_output_is_the_engines_whatever_the_draft_counts(make_loop, model_dir):
    loop = make_loop()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [loop.engine.tokenizer.encode(p) for p in PROMPTS]

    async def through_loop():
        return await asyncio.gather(*[_collect(loop, f"g{i}", p, params) for i, p in enumerate(prompts)])
    served = [t for t, _ in asyncio.run(through_loop())]
    direct = Engine(EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(64, 8)))   # MTP off
    for i, p in enumerate(prompts):
        direct.add_request(f"d{i}", p, params)
    out = {f"d{i}": [] for i in range(len(prompts))}
    while direct.has_work:
        for event in direct.step():
            out[event.request_id] += event.token_ids
    assert served == [out[f"d{i}"] for i in range(len(prompts))]


def test_the_first_event_says_how_long_its_request_queued_and_prefilled(make_loop):
    """With one state row the second request waits for the first to finish: its queue time
    covers that wait, and only a request's first event with tokens carries the two times."""
    loop = make_loop(rows=1)
    ids = loop.engine.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def two():
        async def run(rid):
            started, events = time.monotonic(), []
            async for event in loop.submit(rid, ids, params):
                events.append((time.monotonic(), event))
            return started, events
        return await asyncio.gather(run("first"), run("second"))
    (started, first), (_, second) = asyncio.run(two())
    for events in (first, second):
        timed = [e for _, e in events if e.queue_s is not None]
        assert len(timed) == 1 and timed[0] is events[0][1] and timed[0].prefill_s > 0
    first_ran_s = first[-1][0] - started
    assert first[0][1].queue_s < 0.5 * first_ran_s
    assert second[0][1].queue_s > 0.8 * first_ran_s, "the wait for the state row is queue time"


def test_a_long_turn_of_the_owner_thread_is_kept_as_a_stall_with_what_took_the_time(make_loop):
    """A call that blocks the owner thread for 80 ms (and collects garbage) while a request
    decodes, then one that keeps it busy 80 ms: status lists both turns as stalls, their time in
    the commands, the collection's time apart, and how much of it the thread was on the CPU; the
    request's steps around them are not stalls."""
    loop = make_loop()
    os.setpriority(os.PRIO_PROCESS, loop._thread.native_id, os.getpriority(os.PRIO_PROCESS, 0) + 3)
    ids = loop.engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def scenario():
        stream = loop.submit("r", ids, params)
        tokens = 0
        async for event in stream:
            tokens += len(event.token_ids)
            if tokens >= 5 and tokens - len(event.token_ids) < 5:
                await loop.call(lambda _: (time.sleep(0.08), gc.collect()))
            if tokens >= 15 and tokens - len(event.token_ids) < 15:
                await loop.call(lambda _: _spin(0.08))
        return await loop.status()
    status = asyncio.run(scenario())
    assert status["num_stalls"] >= 1
    assert status["owner_niceness"] == os.getpriority(os.PRIO_PROCESS, 0) + 3, "the owner thread's own"
    blocked, spun = [s for s in status["stalls"] if s["commands_ms"] >= 75]    # in turn order
    assert blocked["turn_ms"] >= blocked["commands_ms"]
    assert blocked["gc_ms"] > 0 and blocked["commands_ms"] - blocked["gc_ms"] >= 75, \
        "the collection is counted, the sleep is not"
    assert blocked["cpu_ms"] < blocked["turn_ms"] - 60, "a sleeping owner thread is off the CPU"
    assert spun["cpu_ms"] >= 75, "a spinning owner thread is on it"
    assert len(status["stalls"]) <= 4, "ordinary steps are not stalls"


def _spin(seconds: float) -> None:
    """Keep this thread on the CPU for ``seconds`` of its own CPU time (however busy the host)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_launch_builds_the_engine_on_the_owner_thread_and_says_why_it_cannot(model_dir, tmp_path):
    """``launch`` builds the engine on the thread that steps it (ORT's CUDA graphs and cuDNN
    handles are per thread); an engine handed over from another thread is reported as such; a
    build that fails raises its error in the caller and leaves no thread running."""
    config = EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(64, 4), spec=SpecConfig(0))
    builders = []

    def build():
        builders.append(threading.current_thread())
        return Engine(config)
    launched = EngineLoop.launch(build, max_pending=8).start()
    handed = EngineLoop(Engine(config)).start()
    try:
        ids = launched.engine.tokenizer.encode(PROMPTS[0])
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        tokens, _ = asyncio.run(_collect(launched, "r", ids, params))
        assert len(tokens) == 8 and launched.max_pending == 8
        assert builders == [launched._thread] and launched._thread is not threading.current_thread()
        assert asyncio.run(launched.status())["built_on_owner_thread"]
        assert not asyncio.run(handed.status())["built_on_owner_thread"]
    finally:
        launched.stop()
        handed.stop()
    before = threading.active_count()
    with pytest.raises(Exception, match=str(tmp_path)):
        EngineLoop.launch(lambda: Engine(EngineConfig(str(tmp_path), num_threads=1)))
    assert threading.active_count() == before


def test_with_stall_phases_a_stall_says_which_phase_of_its_step_took_the_time(model_dir):
    """One main forward made 80 ms slower: its turn is a stall whose step time is that phase's."""
    config = EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(64, 8), spec=SpecConfig(0))
    engine = Engine(config)
    run_main, calls = engine.runner.run_main, []

    def slow_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 8:
            time.sleep(0.08)
        return run_main(*args, **kwargs)
    engine.runner.run_main = slow_once              # before the loop's timers wrap it
    loop = EngineLoop(engine, stall_phases=True).start()
    try:
        ids = engine.tokenizer.encode(PROMPTS[2])
        tokens, _ = asyncio.run(_collect(loop, "r", ids, SamplingParams(temperature=0, max_tokens=20,
                                                                         ignore_eos=True)))
        status = asyncio.run(loop.status())
    finally:
        loop.stop()
    assert len(tokens) == 20
    (stall,) = [s for s in status["stalls"] if s["step_ms"] >= 75]
    assert next(iter(stall["phases_ms"])) in ("verify", "main eager")    # the largest phase: the slowed one
    assert stall["phases_ms"]["main eager"] >= 75


def test_refusals_happen_before_anything_is_queued(make_loop):
    loop = make_loop(rows=1, max_pending=2)
    ids = loop.engine.tokenizer.encode(PROMPTS[1])
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def scenario():
        with pytest.raises(ValueError, match="context"):
            loop.submit("huge", [5] * loop.limits.context_length, long)
        streams = [loop.submit("a", ids, long)]
        while loop._num_queued:                            # until 'a' is admitted and holds the only row
            await asyncio.sleep(0.01)
        streams += [loop.submit("b", ids, long), loop.submit("c", ids, long)]
        with pytest.raises(Overloaded):
            loop.submit("d", ids, long)
        for s in streams:
            s.cancel()
    asyncio.run(scenario())
    assert _status(loop)["idle_and_empty"]


def test_an_engine_failure_fails_every_request_and_refuses_new_ones(make_loop):
    loop = make_loop()
    ids = loop.engine.tokenizer.encode(PROMPTS[2])

    def broken_step():
        raise RuntimeError("device lost")
    loop.engine.step = broken_step

    async def scenario():
        with pytest.raises(EngineFailed, match="device lost"):
            await _collect(loop, "x", ids, SamplingParams(max_tokens=4))
        with pytest.raises(EngineFailed):
            loop.submit("y", ids, SamplingParams(max_tokens=4))
    asyncio.run(scenario())
    assert loop.snapshot.failed is not None


def test_a_reader_that_falls_behind_gets_the_waiting_events_as_one(make_loop):
    """Under load the replica writes one chunk per read, not one per step: nothing lost or reordered."""
    loop = make_loop(adaptive=False)
    ids = loop.engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)

    async def read(delay_s: float):
        stream = loop.submit(f"r{delay_s}", ids, params)
        await asyncio.sleep(delay_s)                        # the engine runs ahead of this reader
        return [e async for e in stream]
    prompt = asyncio.run(read(0.0))
    late = asyncio.run(read(3.0))
    assert len(late) < len(prompt) and len(late) <= 2, "waiting events were merged"
    for events in (prompt, late):
        assert sum(len(e.token_ids) for e in events) == 20 == sum(len(e.logprobs) for e in events)
    assert [t for e in late for t in e.token_ids] == [t for e in prompt for t in e.token_ids]
    assert "".join(e.text for e in late) == "".join(e.text for e in prompt)
    assert late[-1].finish_reason is FinishReason.LENGTH and late[-1].num_output_tokens == 20


def test_an_error_behind_waiting_events_comes_after_them():
    from mtpserve.actors.engine_loop import RequestStream
    from mtpserve.engine.request import TokenEvent

    class Owner:
        def abort(self, request_id):
            pass

    async def scenario():
        stream = RequestStream("x", Owner())
        for i in range(3):
            stream.put(TokenEvent("x", [i], str(i)))
        stream.put(EngineFailed("gone"))
        first = await stream.__anext__()
        assert first.token_ids == [0, 1, 2] and first.text == "012"
        with pytest.raises(EngineFailed):
            await stream.__anext__()
    asyncio.run(scenario())


def test_a_paced_stream_reads_at_most_once_per_interval_and_loses_nothing(make_loop):
    """Through Serve's proxy a stream is paced (``RequestStream.pace``): reads come at least the
    interval apart and each carries the steps' tokens in between, in order, the end included."""
    loop = make_loop(adaptive=False)
    ids = loop.engine.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    interval_s = 0.05

    async def read(paced: bool):
        stream = loop.submit(f"p{paced}", ids, params)
        if paced:
            stream.pace = lambda: interval_s
        events, times = [], []
        async for e in stream:
            events.append(e)
            times.append(asyncio.get_running_loop().time())
        return events, times
    plain, _ = asyncio.run(read(False))
    paced, times = asyncio.run(read(True))
    assert all(b - a >= interval_s * 0.99 for a, b in zip(times, times[1:])), "reads closer than the pace"
    assert len(paced) < len(plain), "the steps between two paced reads come as one event"
    assert [t for e in paced for t in e.token_ids] == [t for e in plain for t in e.token_ids]
    assert "".join(e.text for e in paced) == "".join(e.text for e in plain)
    assert paced[-1].finish_reason is FinishReason.LENGTH and paced[-1].num_output_tokens == 24


def test_export_sessions_gives_each_sessions_cached_prefix_most_recent_first_within_the_budget(make_loop):
    """Two sessions' first turns; the export brings the most recent first and skips what does not
    fit; imported into another engine, the other session's next turn starts from its prefix and
    gives the tokens that engine computes without it."""
    loop, other = make_loop(), make_loop()
    tok = loop.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = {s: tok.encode("".join(f"{s}_{i} = {s}_{i - 1} * {i}\n" for i in range(1, 12))) for s in ("a", "b")}

    async def turn(target, rid, ids, session):
        tokens, last = [], None
        async for event in target.submit(rid, ids, params, session):
            tokens, last = tokens + event.token_ids, event
        return tokens, last
    outputs = {s: asyncio.run(turn(loop, f"{s}1", prompts[s], s))[0] for s in ("a", "b")}    # b finishes last
    everything = asyncio.run(loop.export_sessions(1 << 30, 10.0))
    assert [s for s, _ in everything] == ["b", "a"]
    sizes = {s: sum(len(d) + len(b) for d, b in r) for s, r in everything}
    only_b = asyncio.run(loop.export_sessions(sizes["b"], 10.0))
    assert [s for s, _ in only_b] == ["b"], "a no longer fits beside b"
    assert asyncio.run(loop.export_sessions(0, 10.0)) == []

    records = dict(everything)["a"]
    n = len(prompts["a"])
    assert asyncio.run(other.call(lambda engine: engine.import_prefix(records))) == (n - 1) // 16 * 16
    nxt = prompts["a"] + outputs["a"] + tok.encode("\nc = a_3\n")
    moved, event = asyncio.run(turn(other, "a2", nxt, "a"))
    assert event.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert moved == asyncio.run(turn(make_loop(), "fresh", nxt, None))[0]
    assert _status(other)["idle_and_empty"]
