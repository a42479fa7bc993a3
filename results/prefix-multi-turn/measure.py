"""Multi-turn chat with the prefix cache on vs off, MTP off and K=2, on the bundled model, this CPU.

Each conversation has TURNS turns: turn t's prompt is turn t-1's prompt, its answer (the
tokens generated) and a new user message, as a chat client sends it. CONVERSATIONS of them run
with C at once (closed loop: a conversation's next turn starts when its answer is complete).
Turns but the last are sent as a session's (``continues``: the cache snapshots their prompts'
boundaries, as the server does for a request with a session id). Per configuration: TTFT of
first turns and of later turns (p50), output tokens/s, the share of prompt tokens served from
the cache, and whether every answer equals the cache-off engine's.

    python results/prefix-multi-turn/measure.py OUT.json
"""
import json
import sys
import time
from collections import deque

import numpy as np

sys.path.insert(0, "tests/engine")
from test_engine import PROMPTS, make_engine  # noqa: E402

from mtpserve.engine.bundled import MODEL_DIR  # noqa: E402
from mtpserve.engine.sampler import SamplingParams  # noqa: E402

CONVERSATIONS, TURNS, ANSWER = 8, 4, 48
SYSTEM = ("# You are a careful Python assistant. Answer with code only.\n"
          "import os\nimport sys\nimport json\nimport logging\nfrom pathlib import Path\n\n"
          "logger = logging.getLogger(__name__)\n\n") * 3


def converse(engine, concurrency: int) -> dict:
    tok = engine.tokenizer
    system = tok.encode(SYSTEM)
    user = [[tok.encode(f"\n# request {c}.{t}\n" + PROMPTS[(c * TURNS + t) % len(PROMPTS)]) for t in range(TURNS)]
            for c in range(CONVERSATIONS)]
    params = SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True)
    history = {c: system + user[c][0] for c in range(CONVERSATIONS)}
    turn = dict.fromkeys(range(CONVERSATIONS), 0)
    waiting, active = deque(range(CONVERSATIONS)), {}
    answers, ttft = {}, {"first": [], "later": []}
    hits0, queries0 = (engine.prefix_cache.stats.hits, engine.prefix_cache.stats.queries) if engine.prefix_cache else (0, 0)
    started, out_tokens = time.perf_counter(), 0

    def submit(c):
        rid = f"c{c}t{turn[c]}"
        engine.add_request(rid, history[c], params, continues=turn[c] < TURNS - 1)   # a session's turn
        active[rid] = [c, time.perf_counter(), None, []]
    while waiting and len(active) < concurrency:
        submit(waiting.popleft())
    while active:
        for ev in engine.step():
            a = active[ev.request_id]
            if ev.token_ids and a[2] is None:
                a[2] = time.perf_counter() - a[1]
            a[3] += ev.token_ids
            out_tokens += len(ev.token_ids)
            if ev.finish_reason is not None:
                c, _, first, ids = active.pop(ev.request_id)
                answers[ev.request_id] = ids
                ttft["first" if turn[c] == 0 else "later"].append(first)
                turn[c] += 1
                if turn[c] < TURNS:
                    history[c] = history[c] + ids + user[c][turn[c]]
                    waiting.appendleft(c)          # the same client sends its next turn at once
                while waiting and len(active) < concurrency:
                    submit(waiting.popleft())
    seconds = time.perf_counter() - started
    engine.check_integrity()
    assert engine.is_idle_and_empty()
    hits, queries = ((engine.prefix_cache.stats.hits - hits0, engine.prefix_cache.stats.queries - queries0)
                     if engine.prefix_cache else (0, 1))
    return {"ttft_first_p50_ms": 1e3 * float(np.median(ttft["first"])),
            "ttft_later_p50_ms": 1e3 * float(np.median(ttft["later"])),
            "tok_s": out_tokens / seconds, "cached_share": hits / max(queries, 1), "answers": answers}


rows = []
for k in (0, 2):
    for concurrency in (1, 4):
        for rnd in range(2):
            for cache in ((True, False) if rnd % 2 == 0 else (False, True)):
                engine = make_engine(MODEL_DIR, k=k, prefix_cache=cache)
                r = converse(engine, concurrency)
                rows.append({"k": k, "concurrency": concurrency, "round": rnd, "prefix_cache": cache, **r})
                print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in rows[-1].items() if key != "answers"},
                      flush=True)
for row in rows:
    off = next(o for o in rows if not o["prefix_cache"] and (o["k"], o["concurrency"], o["round"])
               == (row["k"], row["concurrency"], row["round"]))
    row["answers_equal_cache_off"] = row["answers"] == off["answers"]
for row in rows:
    del row["answers"]
json.dump({"conversations": CONVERSATIONS, "turns": TURNS, "answer_tokens": ANSWER, "runs": rows},
          open(sys.argv[1], "w"), indent=1)
print("every answer equal to the cache-off engine's:", all(r["answers_equal_cache_off"] for r in rows))
