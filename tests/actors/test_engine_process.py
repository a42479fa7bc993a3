"""The engine in a process of its own (CUDA replicas' default), without Ray: the same output as the
engine's own thread, aborts free, refusals come first, and a dead engine process is a clear error."""
import asyncio
import dataclasses
import os
import resource
import signal
import socket
import threading
import time
from operator import methodcaller

import pytest
from test_engine_loop import _collect

from mtpserve.actors.engine_loop import EngineFailed, EngineLoop, Overloaded
from mtpserve.actors.engine_process import EngineProcess, event_from_wire, event_to_wire
from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.request import FinishReason, TokenEvent
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.tokenizer import Tokenizer

PROMPTS = ["def add(a, b):", "import os\nimport", "class Stack:\n    def", "for i in range("]


@pytest.fixture
def make_process(model_dir):
    started = []

    def make(rows=8, max_pending=1024, draft_tokens=2, num_clients=0):
        config = EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(64, rows), spec=SpecConfig(draft_tokens))
        process = EngineProcess(config, max_pending, num_clients=num_clients).start()
        started.append(process)
        return process
    yield make
    for process in started:
        process.stop()
        assert process._proc.poll() is not None, "the engine process is gone after stop"


def _routing_index(engine) -> bytes:
    return engine.prefix_cache.routing_index(4096)


def _run_all(loop, prompts, params):
    async def go():
        return await asyncio.gather(*[_collect(loop, f"r{i}", p, params) for i, p in enumerate(prompts)])
    return asyncio.run(go())


def test_greedy_output_and_logprobs_equal_the_engine_thread_with_mtp_on(make_process, model_dir):
    process = make_process(draft_tokens=2)
    tok = Tokenizer(process.manifest.path)
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    in_process = _run_all(process, prompts, params)
    thread = EngineLoop(Engine(EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(64, 8),
                                            spec=SpecConfig(0)))).start()       # MTP off, own thread
    try:
        reference = _run_all(thread, prompts, params)
    finally:
        thread.stop()
    assert [t for t, _ in in_process] == [t for t, _ in reference]
    assert all(e.finish_reason is FinishReason.LENGTH for _, e in in_process)
    status = asyncio.run(process.status())
    assert status["integrity"] == "ok" and status["idle_and_empty"] and status["engine_pid"] == process.pid
    assert status["built_on_owner_thread"], "the engine steps on the thread that built it (ORT's graphs are per thread)"
    assert status["spec"]["num_draft_tokens"] > 0, "MTP drafted in the engine process"
    assert process.snapshot.num_steps > 0 and process.snapshot.spec.num_emitted_tokens == 4 * 32
    # the prefix cache's routing index crosses the pipe only when it changed, and the replica
    # keeps it between those snapshots: it is the child's index, also after later snapshots
    child_index = asyncio.run(process.call(_routing_index))
    assert child_index and process.snapshot.prefix_index == child_index
    seen = process.snapshot.taken_at
    deadline = time.monotonic() + 10
    while process.snapshot.taken_at == seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.snapshot.taken_at != seen and process.snapshot.prefix_index == child_index


def test_an_attached_client_gets_its_own_events_and_its_closing_aborts_its_requests(make_process):
    """Two pipes into one engine process (an API server's is the second): each client's greedy
    output equals the other's for the same prompt, no event reaches the wrong client, the
    attached one sees the replica's grant, and when its pipe closes its requests are aborted
    (blocks and rows freed) while the engine keeps serving the replica."""
    process = make_process(draft_tokens=2, num_clients=1)
    client = EngineProcess.attach(process.client_conns[0], process.info)
    tok = Tokenizer(process.manifest.path)
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def both():
        mine = [_collect(process, f"a{i}", p, params) for i, p in enumerate(prompts)]
        theirs = [_collect(client, f"b{i}", p, params) for i, p in enumerate(prompts)]
        return await asyncio.gather(*mine, *theirs)
    results = asyncio.run(both())
    assert [t for t, _ in results[:4]] == [t for t, _ in results[4:]]
    assert all(len(t) == 16 and e.finish_reason is FinishReason.LENGTH for t, e in results)
    assert not process._streams and not client._streams, "every stream got its final event"
    process.set_grant(60, 6)
    deadline = time.monotonic() + 10
    while client._grant.num_blocks_granted != 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (client._grant.num_blocks_granted, client._grant.num_rows_granted) == (60, 6)

    emitted = process.snapshot.spec.num_emitted_tokens

    async def left_running():          # the client's request is running when its pipe closes
        stream = client.submit("c0", prompts[0], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        await stream.__anext__()
        with socket.socket(fileno=os.dup(client._conn.fileno())) as end:   # as when its process exits
            end.shutdown(socket.SHUT_RDWR)
        for _ in range(200):
            status = await process.status()
            if status["idle_and_empty"]:
                return status
            await asyncio.sleep(0.05)
        return status
    status = asyncio.run(left_running())
    assert status["idle_and_empty"] and status["integrity"] == "ok"
    assert process.snapshot.spec.num_emitted_tokens - emitted < 900, "aborted, not run to its end"
    tokens, event = asyncio.run(_collect(process, "after", prompts[1], params))
    assert tokens == results[1][0] and event.finish_reason is FinishReason.LENGTH


def test_every_field_of_a_token_event_crosses_the_pipe():
    """Events cross the pipe as plain tuples: each field arrives as sent, a field added to
    TokenEvent included (its value here differs from its default, so dropping it fails)."""
    values = {"request_id": "r-1", "token_ids": [5, 7], "text": "ab", "finish_reason": FinishReason.LENGTH,
              "num_prompt_tokens": 3, "num_output_tokens": 2, "num_cached_tokens": 1,
              "logprobs": [(5, -0.1, [(5, -0.1)])], "prompt_logprobs": [(9, -2.0, [])],
              "queue_s": 0.25, "prefill_s": 0.5}
    assert set(values) == {f.name for f in dataclasses.fields(TokenEvent)}, "a new TokenEvent field: give it a value"
    for finish in (FinishReason.LENGTH, None):
        event = TokenEvent(**{**values, "finish_reason": finish})
        assert event_from_wire(event_to_wire(event)) == event


def test_closing_streams_aborts_running_and_waiting_requests_in_the_engine_process(make_process):
    process = make_process(rows=1)
    ids = Tokenizer(process.manifest.path).encode(PROMPTS[0])
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def scenario():
        running, waiting = process.submit("run", ids, long), process.submit("wait", ids, long)
        first = await running.__anext__()                  # it runs; the other waits for the one row
        assert first.token_ids
        running.cancel()
        waiting.cancel()
        return await process.status()
    status = asyncio.run(scenario())         # commands are FIFO: both aborts were applied before it
    assert status["num_pending"] == 0 and status["idle_and_empty"] and status["integrity"] == "ok"


def test_refusals_come_before_anything_is_queued(make_process):
    process = make_process(rows=1, max_pending=2)
    ids = Tokenizer(process.manifest.path).encode(PROMPTS[1])
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def scenario():
        with pytest.raises(ValueError, match="context"):
            process.submit("huge", [5] * process.limits.context_length, long)
        with pytest.raises(ValueError, match="token ids"):
            process.submit("bad", [process.limits.vocab_size], long)
        streams = [process.submit("a", ids, long)]
        await streams[0].__anext__()                       # 'a' holds the only row
        streams += [process.submit("b", ids, long), process.submit("c", ids, long)]
        with pytest.raises(Overloaded, match="already waiting"):
            process.submit("d", ids, long)
        for s in streams:
            s.cancel()
        return await process.status()
    assert asyncio.run(scenario())["idle_and_empty"]


def test_a_dead_engine_process_fails_open_streams_and_refuses_new_requests(make_process):
    process = make_process()
    ids = Tokenizer(process.manifest.path).encode(PROMPTS[2])

    async def scenario():
        stream = process.submit("x", ids, SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        await stream.__anext__()
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(EngineFailed, match="engine process exited"):
            async for _ in stream:
                pass
        with pytest.raises(EngineFailed):
            process.submit("y", ids, SamplingParams(max_tokens=4))
        with pytest.raises(EngineFailed):
            await process.status()
    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert process.failed is not None


def test_an_engine_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="could not start") as info:
        EngineProcess(EngineConfig(str(tmp_path), num_threads=1)).start()
    assert str(tmp_path) in str(info.value)


def test_the_engine_process_ends_when_its_replica_is_killed(model_dir, tmp_path):
    """A replica killed without cleanup (SIGKILL, OOM) must not leave its engine process (and on
    a GPU its memory) behind: the engine process sees its connection close and stops."""
    import subprocess
    import sys
    import time
    script = tmp_path / "replica.py"
    script.write_text(
        "import sys, time\n"
        "from mtpserve.actors.engine_process import EngineProcess\n"
        "from mtpserve.engine.config import EngineConfig\n"
        f"p = EngineProcess(EngineConfig({str(model_dir)!r}, num_threads=1)).start()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(replica.stdout.readline())
        os.kill(engine_pid, 0)                            # running
        replica.kill()
        replica.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            try:                                          # reap it if it is our grandchild's zombie
                os.waitpid(engine_pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
        else:
            os.kill(engine_pid, signal.SIGKILL)
            raise AssertionError("the engine process outlived its replica by 30 s")
    finally:
        replica.kill()


def test_structured_output_in_the_engine_process_is_valid_and_equals_the_thread(make_process, model_dir):
    """A grammar travels with its request (SamplingParams is plain data) and is compiled on the
    engine process's command thread: valid JSON, the same tokens as the engine thread, MTP on."""
    import json

    from mtpserve.engine.grammar import GrammarSpec
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = SamplingParams(temperature=0, max_tokens=80, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    process = make_process(draft_tokens=2)
    tok = Tokenizer(process.manifest.path)
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    got = _run_all(process, prompts, params)
    thread = EngineLoop(Engine(EngineConfig(str(model_dir), num_threads=1, cache=CacheConfig(64, 8),
                                            spec=SpecConfig(0)))).start()
    try:
        reference = _run_all(thread, prompts, params)
    finally:
        thread.stop()
    assert [t for t, _ in got] == [t for t, _ in reference]
    for tokens, last in got:
        value = json.loads(tok.decode(tokens))
        assert last.finish_reason is FinishReason.STOP and set(value) == {"name", "age"}
    assert asyncio.run(process.status())["integrity"] == "ok"


def test_export_sessions_in_the_engine_process_gives_the_sessions_prefix(make_process):
    process = make_process()
    tok = Tokenizer(process.manifest.path)
    ids = tok.encode("".join(f"v{i} = v{i - 1} + {i}\n" for i in range(1, 12)))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def turn():
        return [t async for event in process.submit("s1", ids, params, "sess") for t in event.token_ids]
    output = asyncio.run(turn())
    ((session, records),) = asyncio.run(process.export_sessions(1 << 30, 10.0))
    assert session == "sess" and len(records) == (len(ids) - 1) // 16 > 0
    assert records == asyncio.run(process.call(methodcaller("export_prefix", ids + output)))


@pytest.mark.skipif(os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_NICE)[0] < 20,
                    reason="this host does not let a process raise its priority back to nice 0")
def test_an_engine_process_started_below_normal_priority_goes_back_to_nice_0(model_dir):
    """Ray's workers run at nice 15 and the engine process inherits it from the replica's thread:
    it returns to 0 before it starts a thread, and its steps' threads with it."""
    started = {}

    def start_niced():                        # on Linux a thread's nice value is its own
        os.setpriority(os.PRIO_PROCESS, 0, 10)
        started["process"] = EngineProcess(EngineConfig(str(model_dir), num_threads=1)).start()
    thread = threading.Thread(target=start_niced)
    thread.start()
    thread.join()
    process = started["process"]
    try:
        tids = os.listdir(f"/proc/{process.pid}/task")
        assert len(tids) > 1 and all(os.getpriority(os.PRIO_PROCESS, int(t)) == 0 for t in tids)
    finally:
        process.stop()
