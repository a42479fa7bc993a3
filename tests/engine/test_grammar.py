"""Structured output in the engine on the bundled model: every output valid, MTP exact with a grammar."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from mtpserve.engine.grammar import GrammarCompiler, GrammarManager, GrammarSpec
from mtpserve.engine.sampler import SamplingParams

from test_engine import make_engine, run_all, run_requests

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "enum": ["io", "os", "re"]},
                                               "minItems": 1, "maxItems": 4},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"function": {"type": "string", "pattern": "^[a-z_]{1,12}$"},
                                      "args": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99},
                                               "maxItems": 3},
                                      "kind": {"enum": ["def", "class", None]}},
     "required": ["function", "args", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 999}, "y": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["x", "y"], "additionalProperties": False},
        "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
     "required": ["point", "label"], "additionalProperties": False},
]
PROMPTS = [CHAT.format("Write the Python function `parse` of the module `json`."), "def main():\n    ",
           CHAT.format("Describe a user as JSON."), "import os\nimport sys\n", "x = {", CHAT.format("Give me a point."),
           "class Config:\n    ", "    for i in range(", CHAT.format("Tags?"), "# Copyright"]
# 20 (prompt, schema) pairs: every prompt with two schemas
CASES = [(p, SCHEMAS[(i + j) % len(SCHEMAS)]) for i, p in enumerate(PROMPTS) for j in (0, 1)]


def _params(schema, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=160, grammar=GrammarSpec("json_schema", json.dumps(schema)), **kw)


def _validated(engine, tokens, reasons, schemas) -> list[str]:
    texts = []
    for i, schema in enumerate(schemas):
        text = engine.tokenizer.decode(tokens[f"r{i}"])
        assert reasons[f"r{i}"].value == "stop", (text, reasons[f"r{i}"])
        jsonschema.validate(json.loads(text), schema)
        texts.append(text)
    return texts


@pytest.fixture(scope="module")
def greedy_json(model_dir):
    engine = make_engine(model_dir, k=0, budget=48)
    tokens, reasons = run_all(engine, [p for p, _ in CASES], [_params(s, temperature=0) for _, s in CASES])
    return engine, tokens, reasons


def test_json_schema_output_parses_and_validates_for_20_prompts(greedy_json):
    engine, tokens, reasons = greedy_json
    texts = _validated(engine, tokens, reasons, [s for _, s in CASES])
    assert len(set(texts)) > 10, "the prompts and schemas should give varied answers"


@pytest.mark.parametrize("k", [2, 3])
def test_greedy_with_a_grammar_is_token_identical_mtp_on_and_off(model_dir, greedy_json, k):
    """Verify row j is masked with the grammar after drafts 0..j-1, drafts come from the masked
    head, and the matcher is rolled back to the accepted length: the same tokens as K=0."""
    engine = make_engine(model_dir, k=k, budget=48)
    tokens, reasons = run_all(engine, [p for p, _ in CASES], [_params(s, temperature=0) for _, s in CASES])
    assert tokens == greedy_json[1]
    _validated(engine, tokens, reasons, [s for _, s in CASES])
    s = engine.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens      # both rollback and acceptance happened
    # measured: 0.747 (K=2), 0.730 (K=3); drafts from the head's unmasked logits: 0.218, 0.163
    assert s.acceptance_rate > 0.6, s.acceptance_rate_per_position
    assert not engine.grammars.request_ids


def test_sampled_output_with_mtp_is_always_valid(model_dir):
    """Sampling (temperature 1.3, K=3): exact speculative sampling over masked target and draft
    distributions; whatever is drawn and however many drafts are rejected, the output validates."""
    engine = make_engine(model_dir, k=3, budget=48)
    params = [_params(s, temperature=1.3, seed=i) for i, (_, s) in enumerate(CASES)]
    tokens, reasons = run_all(engine, [p for p, _ in CASES], params)
    _validated(engine, tokens, reasons, [s for _, s in CASES])
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens


@pytest.mark.parametrize("k", [0, 3])
def test_regex_choice_and_ebnf_outputs_match_with_mtp_on_as_off(model_dir, k):
    specs = [GrammarSpec("regex", r"[a-z]{2,6}\([0-9], [0-9]\)", "guided_regex"),
             GrammarSpec("choice", json.dumps(["os.path", "sys.argv", "re.compile"]), "guided_choice"),
             GrammarSpec("grammar", 'root ::= "def " name "(" name ("," name)? "):"\nname ::= [a-z] [a-z_]*', "guided_grammar"),
             GrammarSpec("json_object", "")]
    engine = make_engine(model_dir, k=k)
    tokens, reasons = run_all(engine, ["def f(x):\n    return "] * 4,
                              [SamplingParams(temperature=0, max_tokens=60, grammar=g) for g in specs])
    texts = [engine.tokenizer.decode(tokens[f"r{i}"]) for i in range(4)]
    assert all(r.value == "stop" for r in reasons.values()), (texts, reasons)
    assert re.fullmatch(r"[a-z]{2,6}\([0-9], [0-9]\)", texts[0])
    assert texts[1] in ("os.path", "sys.argv", "re.compile")
    assert re.fullmatch(r"def [a-z][a-z_]*\([a-z][a-z_]*(,[a-z][a-z_]*)?\):", texts[2])
    assert isinstance(json.loads(texts[3]), dict)


def test_matcher_masks_follow_drafts_and_roll_back(model_dir):
    """row_masks: row j after drafts 0..j-1, a forbidden draft ends the chain (its row forbids
    it), and the matcher is where it was; speculate + rollback likewise."""
    engine = make_engine(model_dir, k=0)
    tok = engine.tokenizer
    manager = GrammarManager(engine.grammars.compiler)
    manager.start("a", GrammarSpec("regex", "abc|abd|xyz"))
    a, b, c, x = (tok.encode(s)[0] for s in "abcx")
    masks = manager.row_masks("a", [a, b])
    assert masks[0][a] and masks[0][x] and not masks[0][b]
    assert masks[1][b] and not masks[1][a] and not masks[1][x]
    assert masks[2][c] and not masks[2][b]
    assert (manager.mask("a") == masks[0]).all()               # back at the start
    masks = manager.row_masks("a", [b, a])                     # b is forbidden first
    assert not masks[0][b] and masks[1].all() and masks[2].all()
    assert manager.speculate("a", a) and not manager.speculate("a", a) and not manager.speculate("a", b)
    manager.rollback("a")
    assert (manager.mask("a") == masks[0]).all()
    manager.advance("a", [x])
    y = tok.encode("y")[0]
    assert manager.mask("a")[y] and not manager.mask("a")[a]
    manager.forget("a")
    assert not manager.request_ids


def test_a_bitmask_unpacks_bit_for_bit_and_masks_exactly_its_rows(model_dir):
    """The host's unpacking of xgrammar's int32 words (bit 31, the sign, included) and
    ``mask_rows``: -inf exactly where a row's bit is clear, other rows untouched. (On a GPU one
    kernel applies the words: test_cuda checks it against this unpacking.)"""
    engine = make_engine(model_dir, k=0)
    manager = GrammarManager(engine.grammars.compiler)
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31, size=(5, (engine.grammars.compiler.vocab_size + 31) // 32),
                           dtype=np.int64).astype(np.int32)
    bitmask[0] = -1
    bitmask[1] = 0
    host = manager.allowed(bitmask)
    assert host.shape == (5, engine.grammars.compiler.vocab_size) and host[0].all() and not host[1].any()
    assert host[2, 31] == bool(bitmask[2, 0] < 0)
    logits = rng.standard_normal((7, host.shape[1])).astype(np.float32)
    masked = logits.copy()
    manager.mask_rows(masked, [4, 0, 6, 1, 2], bitmask)
    for i, row in enumerate([4, 0, 6, 1, 2]):
        np.testing.assert_array_equal(masked[row], np.where(host[i], logits[row], -np.inf))
    np.testing.assert_array_equal(masked[[3, 5]], logits[[3, 5]])


def test_bad_grammars_are_value_errors_naming_the_field_and_leave_nothing(model_dir):
    engine = make_engine(model_dir, k=2)
    compiler = engine.grammars.compiler
    for spec, words in ((GrammarSpec("json_schema", '{"type": "objec"}', "response_format"), "objec"),
                        (GrammarSpec("regex", "(", "guided_regex"), "parenthesis"),
                        (GrammarSpec("grammar", "root ::= foo", "guided_grammar"), "foo")):
        with pytest.raises(ValueError, match=f"^{spec.param} does not compile.*{words}"):
            compiler.compile(spec)
        with pytest.raises(ValueError, match=spec.param):
            engine.add_request("bad", "x", SamplingParams(grammar=spec))
    assert engine.is_idle_and_empty() and not engine.grammars.request_ids
    for kw in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(grammar=GrammarSpec("json_object", ""), **kw)
    assert isinstance(compiler, GrammarCompiler) and compiler.compile(SCHEMAS_SPEC) is compiler.compile(SCHEMAS_SPEC)


SCHEMAS_SPEC = GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))


def test_an_aborted_constrained_request_leaves_no_matcher(model_dir):
    engine = make_engine(model_dir, k=3)
    engine.add_request("a", "x = ", _params(SCHEMAS[1], temperature=0))
    engine.add_request("b", "y = ", SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    engine.step()
    assert engine.grammars.request_ids == {"a"}
    engine.abort("a")
    engine.check_integrity()
    assert not engine.grammars.request_ids
    while engine.has_work:
        engine.step()
    assert engine.is_idle_and_empty()


def test_requests_without_a_grammar_are_untouched(model_dir):
    """A batch mixing constrained and free requests: the free ones give exactly their tokens alone."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone, _ = run_all(make_engine(model_dir, k=2), ["def main():\n    "], [free])
    tokens, _, _ = run_requests(make_engine(model_dir, k=2), ["def main():\n    ", "x = {"],
                                [free, _params(SCHEMAS[0], temperature=0)])
    assert tokens["r0"] == alone["r0"]


def test_without_xgrammar_a_structured_request_is_refused_by_name(model_dir, monkeypatch):
    """The plain install has no xgrammar (it pulls torch): a server still starts, and a request
    asking for structured output gets a ValueError (the HTTP edge's 400) saying what to install."""
    monkeypatch.setattr(GrammarCompiler, "available", staticmethod(lambda: False))
    compiler = GrammarCompiler(model_dir / "tokenizer.json", 4000, (0,))
    assert compiler.preload() is False
    with pytest.raises(ValueError, match=r"mtpserve\[structured\]"):
        compiler.compile(GrammarSpec("regex", "[a-z]+", "response_format"))
