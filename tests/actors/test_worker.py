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
