"""Structured output's cost: grammar engines side by side, and the served engine with a grammar on vs off.

    python -m mtpserve.cluster.bench.grammar engines [--model DIR] [--engines llguidance,xgrammar]
    python -m mtpserve.cluster.bench.grammar cost [--model DIR] [--device cuda] [--concurrency 1,16]
                                                  [--draft-tokens 0,2] [--requests 32]

``engines``: host time to compute one token mask, at batch 1 and 64.

For each engine and each schema (``SCHEMAS``), a valid JSON instance is tokenized with the
model's tokenizer and replayed token by token: every step computes the next-token bitmask of
each matcher in the batch, then consumes the instance's next token (batch 64 = 64 matchers
at staggered offsets into their instances, the masks filled together as a step would).
Reported: mask (+ consume) microseconds per token per request, and compile milliseconds.
xgrammar is optional (it pulls torch); the server depends on the engine this picks
(xgrammar, see README "Structured output").

``cost``: the engine in process (closed loop, C requests in flight) over chat prompts asking
for JSON, each with a JSON schema (greedy), then the same prompts without one for exactly as
many tokens each (ignore_eos): wall time per output token both ways, the grammar's own host
time per token (every GrammarManager call timed), and MTP acceptance with the grammar on vs off.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import time
from pathlib import Path

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "nested": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bc", "def"]}},
        "owner": {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                   "score": {"type": "number"}},
                  "required": ["email", "score"], "additionalProperties": False},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "tags", "owner", "items"], "additionalProperties": False},
        {"id": 7, "tags": ["a", "def", "bc"], "owner": {"email": "x.y@example.org", "score": 3.25},
         "items": [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 10}, {"sku": "QQQ-9999", "qty": 1}]}),
}


# the cost run's schemas: every string, number and array bounded, so a small model's answers end
COST_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["io", "os", "re"]}, "maxItems": 4},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 999}, "y": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["x", "y"], "additionalProperties": False},
        "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"function": {"type": "string", "pattern": "^[a-z_]{1,12}$"},
                                      "args": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99},
                                               "maxItems": 3}}, "required": ["function", "args"], "additionalProperties": False},
]


def _instance_text(value) -> str:
    return json.dumps(value, separators=(",", ":"))


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: list[int]):
        import llguidance
        import llguidance.numpy as lln
        self.ll, self.lln = llguidance, lln
        self.tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.vocab = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        return grammar

    def matcher(self, compiled):
        m = self.ll.LLMatcher(self.tok, compiled)
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, n: int):
        return self.lln.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.lln.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    @staticmethod
    def consume(m, token: int) -> None:
        assert m.consume_token(token), m.get_error()


class _XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: list[int]):
        import xgrammar as xgr
        from tokenizers import Tokenizer
        self.xgr = xgr
        tok = Tokenizer.from_str(tokenizer_json)
        vocab = tok.get_vocab(with_added_tokens=True)
        encoded = [""] * len(vocab)
        for piece, i in vocab.items():
            encoded[i] = piece
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab = len(encoded)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, n: int):
        import numpy as np
        return np.full((n, (self.vocab + 31) // 32), -1, np.int32)

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):          # one matcher at a time, as GrammarManager does
            m.fill_next_token_bitmask(bitmask, i)

    @staticmethod
    def consume(m, token: int) -> None:
        assert m.accept_token(token)


ENGINES = {"llguidance": _LLGuidance, "xgrammar": _XGrammar}


def measure(engine, tokenizer, schema: dict, instance, batch: int, rounds: int) -> dict:
    """Replays ``instance``'s tokens through ``batch`` matchers, each starting at its own offset
    and starting over (a fresh matcher) after the end; microseconds per token per request."""
    t0 = time.perf_counter()
    compiled = engine.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    ids = tokenizer.encode(_instance_text(instance)) + [engine.eos[0]]
    fill_us, consume_us = [], []
    matchers, places = [], []
    for i in range(batch):
        m, place = engine.matcher(compiled), i * len(ids) // batch
        for t in ids[:place]:
            engine.consume(m, t)
        matchers.append(m)
        places.append(place)
    bitmask = engine.bitmask(batch)
    for _ in range(rounds * len(ids)):
        s = time.perf_counter()
        engine.fill(matchers, bitmask)
        f = time.perf_counter()
        for j, m in enumerate(matchers):
            engine.consume(m, ids[places[j]])
            places[j] += 1
        c = time.perf_counter()
        for j in range(batch):
            if places[j] == len(ids):
                matchers[j], places[j] = engine.matcher(compiled), 0
        fill_us.append((f - s) * 1e6 / batch)
        consume_us.append((c - f) * 1e6 / batch)
    return {"batch": batch, "tokens": len(ids), "steps": len(fill_us), "compile_ms": round(compile_ms, 2),
            "mask_us_per_token": round(statistics.median(fill_us), 2),
            "mask_us_per_token_p90": round(sorted(fill_us)[int(0.9 * (len(fill_us) - 1))], 2),
            "consume_us_per_token": round(statistics.median(consume_us), 2)}


TOPICS = ["a user", "a point", "tags of a module", "a function call", "the os module", "a file", "a loop",
          "a class", "an order", "a test"]


class _TimedGrammars:
    """Wraps an engine's GrammarManager methods to add up the host time spent in them (the
    outermost call's: speculate inside fill_row_masks counts once)."""

    def __init__(self, manager):
        self.seconds, self._depth = 0.0, 0
        for name in ("fill_row_masks", "fill_mask", "allowed", "speculate", "rollback", "advance", "start"):
            setattr(manager, name, self._timed(getattr(manager, name)))

    def _timed(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            self._depth += 1
            try:
                return fn(*a, **kw)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.perf_counter() - t
        return timed


def _drive(engine, prompts: list[list[int]], params: list, concurrency: int) -> tuple[float, dict[str, list[int]]]:
    """Closed loop: ``concurrency`` requests in flight, each finished one replaced by the next."""
    tokens: dict[str, list[int]] = {}
    queue = list(enumerate(zip(prompts, params)))
    live = 0
    started = time.perf_counter()
    while queue or engine.has_work:
        while queue and live < concurrency:
            i, (ids, sp) = queue.pop(0)
            engine.add_request(f"q{i}", ids, sp)
            live += 1
        for ev in engine.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason is not None:
                live -= 1
    return time.perf_counter() - started, tokens


def cost(args) -> dict:
    """Grammar on vs off per (K, C); see the module docstring."""
    from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from mtpserve.engine.engine import Engine
    from mtpserve.engine.grammar import GrammarSpec
    from mtpserve.engine.sampler import SamplingParams
    from mtpserve.engine.speculative import SpecDecodeStats
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for k in (int(x) for x in args.draft_tokens.split(",")):
        peak = max(concurrencies)
        engine = Engine(EngineConfig(args.model, device=args.device, num_threads=args.num_threads,
                                     cache=CacheConfig(max_resident_requests=peak),
                                     scheduler=SchedulerConfig(max_requests_per_step=peak),
                                     spec=SpecConfig(draft_tokens=k)))
        timer = _TimedGrammars(engine.grammars)
        tok = engine.tokenizer
        schemas = COST_SCHEMAS
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % 10]} as JSON."}]))
                   for i in range(args.requests)]
        specs = [GrammarSpec("json_schema", json.dumps(schemas[i % len(schemas)])) for i in range(args.requests)]
        for spec in set(specs):          # compiled before the clock starts, as the serving edge does
            engine.grammars.compiler.compile(spec)
        _drive(engine, prompts[:2], [SamplingParams(temperature=0, max_tokens=8, grammar=specs[0])] * 2, 2)   # warm-up
        for c in concurrencies:
            on_s = off_s = grammar_s = float("inf")
            on_stats, off_stats = SpecDecodeStats(), SpecDecodeStats()
            for _ in range(args.repeats):        # on, off, on, off, ...: the best of each (a shared CPU is noisy)
                before, timer.seconds = engine.stats.merged(SpecDecodeStats()), 0.0
                t, on_tokens = _drive(engine, prompts, [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                                       grammar=g) for g in specs], c)
                if t < on_s:
                    on_s, grammar_s = t, timer.seconds
                mid = engine.stats.merged(SpecDecodeStats())
                lengths = [len(on_tokens[f"q{i}"]) for i in range(args.requests)]
                valid = sum(_valid_json(tok.decode(on_tokens[f"q{i}"])) for i in range(args.requests))
                t, _ = _drive(engine, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                for n in lengths], c)
                off_s = min(off_s, t)
                after = engine.stats.merged(SpecDecodeStats())
                on_stats, off_stats = _delta(on_stats, before, mid), _delta(off_stats, mid, after)
            n = sum(lengths)
            row = {"draft_tokens": k, "concurrency": c, "requests": args.requests, "output_tokens": n,
                   "valid_json": valid, "repeats": args.repeats,
                   "on_ms_per_token": round(on_s / n * 1e3, 4), "off_ms_per_token": round(off_s / n * 1e3, 4),
                   "grammar_host_us_per_token": round(grammar_s / n * 1e6, 2),
                   "on_over_off": round(on_s / off_s, 4),
                   "acceptance_on": _rate(on_stats), "acceptance_off": _rate(off_stats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        engine.check_integrity()
    return {"kind": "grammar-cost", "device": args.device, "max_tokens": args.max_tokens, "results": rows}


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _delta(total, a, b):
    """``total`` plus the drafted / accepted counts between snapshots a and b."""
    from mtpserve.engine.speculative import SpecDecodeStats
    return SpecDecodeStats(num_draft_tokens=total.num_draft_tokens + b.num_draft_tokens - a.num_draft_tokens,
                           num_accepted_tokens=total.num_accepted_tokens + b.num_accepted_tokens - a.num_accepted_tokens)


def _rate(s) -> float | None:
    return round(s.num_accepted_tokens / s.num_draft_tokens, 4) if s.num_draft_tokens else None


def main(argv: list[str] | None = None) -> int:
    from mtpserve.cluster.bench.report import machine_info, write_json
    from mtpserve.engine.bundled import MODEL_DIR
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["engines", "cost"])
    p.add_argument("--model", default=str(MODEL_DIR))
    p.add_argument("--out", default="results")
    p.add_argument("--engines", default="llguidance,xgrammar", help="engines: which grammar engines")
    p.add_argument("--batches", default="1,64", help="engines: matchers per step")
    p.add_argument("--rounds", type=int, default=3, help="engines: replays of each instance")
    p.add_argument("--train-vocab", type=int, default=0,
                   help="engines: measure with a byte-level BPE of this many entries trained on the stdlib instead")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cost")
    p.add_argument("--num-threads", type=int, default=0, help="cost: ORT intra-op threads")
    p.add_argument("--concurrency", default="1,16", help="cost: requests in flight")
    p.add_argument("--draft-tokens", default="0,2", help="cost: MTP draft counts")
    p.add_argument("--requests", type=int, default=32, help="cost: requests per configuration")
    p.add_argument("--max-tokens", type=int, default=160, help="cost: max tokens of a constrained answer")
    p.add_argument("--repeats", type=int, default=3, help="cost: rounds of on and off; the best of each is kept")
    args = p.parse_args(argv)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
    if args.mode == "cost":
        payload = {**cost(args), "model": args.model, "machine": machine_info(), "commit": _commit()}
        path = write_json(Path(args.out) / f"{stamp}-grammar-cost-{args.device}-{Path(args.model).name}.json", payload)
        print(f"wrote {path}")
        return 0
    return engines(args, stamp)


def _commit() -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except OSError:
        return None


def _trained_tokenizer(vocab_size: int, out: Path):
    """A byte-level BPE of ``vocab_size`` entries (Qwen's special tokens first) trained on this
    Python's standard library (site-packages left out), the bundled model's data: a large vocabulary where no large
    tokenizer can be fetched. Returns (a Tokenizer over it, its JSON)."""
    import sysconfig
    import tempfile

    from mtpserve.engine.tokenizer import Tokenizer, train_byte_level_bpe
    files = sorted(f for f in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in f.parts)
    texts = []
    for f in files:
        try:
            texts.append(f.read_text())
        except (UnicodeDecodeError, OSError):
            continue
    t0 = time.perf_counter()
    tok = train_byte_level_bpe(texts, vocab_size)
    print(f"trained a {tok.get_vocab_size()}-entry BPE on {len(texts)} files in {time.perf_counter() - t0:.0f} s",
          flush=True)
    folder = Path(tempfile.mkdtemp())
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder), (folder / "tokenizer.json").read_text()


def engines(args, stamp: str) -> int:
    from mtpserve.cluster.bench.report import machine_info, write_json
    from mtpserve.engine.manifest import load_manifest
    from mtpserve.engine.tokenizer import Tokenizer
    model = Path(args.model)
    manifest = load_manifest(model)
    tokenizer = Tokenizer(model)
    tokenizer_json = (model / "tokenizer.json").read_text()
    if args.train_vocab:
        tokenizer, tokenizer_json = _trained_tokenizer(args.train_vocab, Path(args.out))
    rows = []
    for name in args.engines.split(","):
        engine = ENGINES[name](tokenizer_json, list(manifest.eos_token_ids))
        engine.eos = list(manifest.eos_token_ids)
        for schema_name, (schema, instance) in SCHEMAS.items():
            for batch in (int(b) for b in args.batches.split(",")):
                r = {"engine": name, "schema": schema_name, "vocab": engine.vocab,
                     **measure(engine, tokenizer, schema, instance, batch, args.rounds)}
                rows.append(r)
                print(json.dumps(r), flush=True)
    name = f"bpe{args.train_vocab}" if args.train_vocab else manifest.path.name
    path = write_json(Path(args.out) / f"{stamp}-grammar-engines-{name}.json",
                      {"kind": "grammar-engines", "model": str(model), "tokenizer": name, "machine": machine_info(),
                       "commit": _commit(), "results": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
