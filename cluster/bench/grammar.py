"""Grammar engines side by side: host time to compute one token mask, at batch 1 and 64.

    python -m mtpserve.cluster.bench.grammar [--model DIR] [--engines llguidance,xgrammar] [--out results/]

For each engine and each schema (``SCHEMAS``), a valid JSON instance is tokenized with the
model's tokenizer and replayed token by token: every step computes the next-token bitmask of
each matcher in the batch, then consumes the instance's next token (batch 64 = 64 matchers
at staggered offsets into their instances, the masks filled together as a step would).
Reported: mask (+ consume) microseconds per token per request, and compile milliseconds.
xgrammar is optional (it pulls torch); the server depends on the engine this picks
(llguidance, see README "Structured output").
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
        import torch
        t = torch.from_numpy(bitmask)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(t, i)

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


def main(argv: list[str] | None = None) -> int:
    from mtpserve.cluster.bench.report import machine_info, write_json
    from mtpserve.engine.bundled import MODEL_DIR
    from mtpserve.engine.manifest import load_manifest
    from mtpserve.engine.tokenizer import Tokenizer
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(MODEL_DIR))
    p.add_argument("--engines", default="llguidance,xgrammar")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    model = Path(args.model)
    manifest = load_manifest(model)
    tokenizer = Tokenizer(model)
    tokenizer_json = (model / "tokenizer.json").read_text()
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
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
    path = write_json(Path(args.out) / f"{stamp}-grammar-engines-{manifest.path.name}.json",
                      {"kind": "grammar-engines", "model": str(model), "machine": machine_info(), "results": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
