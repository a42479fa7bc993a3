"""The replica's logic outside Serve: a session hand-over that hangs or fails ends by its
deadline and never raises (a stop must not hang), the records travel in bounded calls, and the
replica's engine steps on the thread that built it."""
import asyncio
import time

import pytest

pytest.importorskip("ray")

from mtpserve.actors.worker import Worker, _batches  # noqa: E402
from mtpserve.actors.worker_config import WorkerConfig  # noqa: E402
from mtpserve.engine.config import CacheConfig, EngineConfig  # noqa: E402


@pytest.fixture
def worker(model_dir):
    w = Worker(WorkerConfig(engine=EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(64, 4)),
                            session_handover_timeout_s=0.5))
    yield w
    w.shutdown()


def test_a_hand_over_that_hangs_or_fails_ends_by_its_deadline_and_never_raises(worker):
    async def hangs(max_bytes, budget_s):
        await asyncio.sleep(60)

    async def fails(max_bytes, budget_s):
        raise RuntimeError("the engine went away")
    for export in (hangs, fails):
        worker.loop.export_sessions = export
        started = time.monotonic()
        done = worker.hand_over_sessions()
        assert time.monotonic() - started < 1.6 and (done["sessions"], done["bytes"]) == (0, 0)


def test_records_travel_in_calls_of_bounded_size():
    sessions = [(f"s{i}", [(b"d" * 8, b"x" * n)]) for i, n in enumerate((40, 40, 100, 10))]
    assert [[s for s, _ in b] for b in _batches(sessions, 100)] == [["s0", "s1"], ["s2"], ["s3"]]
    assert _batches([], 100) == []


def test_the_replicas_engine_is_built_on_the_thread_that_steps_it(worker):
    """ONNX Runtime's CUDA provider keeps captured graphs per thread: an engine built on the
    replica's thread and stepped on the loop's would capture each graph again on a live step."""
    status = asyncio.run(worker.engine_status())
    assert status["built_on_owner_thread"] and status["integrity"] == "ok"


def test_finished_requests_count_a_prompt_once_and_a_stream_closed_early_as_an_abort(worker):
    """/metrics as a user adds it up: a prompt with two choices counts its prompt tokens once
    (as usage does) and each choice as a finished request; a stream whose reader goes away
    (a client that disconnected: its request is cancelled) is an "abort" with the tokens it
    had sent, not missing from the finished requests while its TTFT was recorded."""
    from mtpserve.engine.sampler import SamplingParams
    prompt = worker.tokenizer.encode("def add(a, b):")

    async def scenario():
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        streams = await worker.open("two", [prompt], [[params, params]])
        async for _ in worker.run(streams, time.perf_counter()):
            pass
        after_two = worker.recorder.snapshot()
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        streams = await worker.open("gone", [prompt], [[long]])
        reader, sent = worker.run(streams, time.perf_counter()), 0
        async for _, event in reader:
            sent += len(event.token_ids)
            if sent >= 3:
                break
        for s in streams:                  # as the HTTP route does when its client goes away
            s.cancel()
        await reader.aclose()
        return after_two, worker.recorder.snapshot(), sent
    two, gone, sent = asyncio.run(scenario())
    assert two.num_requests == {"length": 2} and two.num_prompt_tokens == len(prompt)
    assert two.num_generation_tokens == 12 and sum(two.e2e.counts) == 2
    assert gone.num_requests == {"length": 2, "abort": 1} and sum(gone.e2e.counts) == 3
    assert gone.num_prompt_tokens == 2 * len(prompt) and gone.num_generation_tokens == 12 + sent
    assert sum(gone.ttft.counts) == 3
