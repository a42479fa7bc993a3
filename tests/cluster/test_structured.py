"""Structured output and forced tool calls over HTTP with MTP on (K=3), through the official openai client."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_serve import ADD, JSON_SCHEMAS, TOPICS, WEATHER, chat_answer  # noqa: E402

from mtpserve.cluster.app import ServeOptions  # noqa: E402
from mtpserve.cluster.client import replica_statuses  # noqa: E402
from mtpserve.cluster.deploy import deployed  # noqa: E402
from mtpserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402
from mtpserve.engine.grammar import GrammarSpec  # noqa: E402
from mtpserve.engine.sampler import SamplingParams  # noqa: E402

APP = "structured"


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    options = ServeOptions.from_flat(model_dir=str(model_dir), num_replicas=1, num_threads=1, draft_tokens=3,
                                     num_cpus_per_replica=0.5)
    with deployed(options, APP, route_prefix=f"/{APP}", timeout_s=60.0):
        client = openai.OpenAI(base_url=f"{ray_cluster['url']}/{APP}/v1", api_key="none", max_retries=0, timeout=120)
        yield {"client": client, "model": options.served_model_name, "model_dir": model_dir}


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe {TOPICS[i % 10]} as JSON."}]


def test_json_schema_output_validates_for_20_prompts_at_k3_and_greedy_matches_mtp_off(app):
    """K=3 over HTTP: 20 answers (greedy and sampled, streamed and not) validate; the greedy ones
    are the tokens the engine gives with MTP off in process."""
    client, model = app["client"], app["model"]
    reference = Engine(EngineConfig(str(app["model_dir"]), num_threads=1, cache=CacheConfig(64, 4)))
    tok = reference.tokenizer
    for i in range(20):
        schema = JSON_SCHEMAS[i % len(JSON_SCHEMAS)]
        greedy = i % 2 == 1
        args = dict(model=model, messages=_messages(i), max_tokens=160, temperature=0 if greedy else 1.2, seed=i,
                    response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        text, finish = chat_answer(client, args, streamed=i % 4 == 3)
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
        if greedy:
            reference.add_request(f"r{i}", tok.apply_chat_template(_messages(i)), SamplingParams(
                temperature=0, max_tokens=160, grammar=GrammarSpec("json_schema", json.dumps(schema))))
            out = ""
            while reference.has_work:
                out += "".join(e.text for e in reference.step())
            assert text == out, i
    drafted = sum(s["spec"]["num_draft_tokens"] for s in replica_statuses(APP).values())
    assert drafted > 0, "the replica drafted nothing: MTP was not on"


def test_forced_tool_call_arguments_validate_at_k3(app):
    client, model = app["client"], app["model"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        for seed in range(3):
            whole = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Add 2 and 3, or say the weather in Rome."}],
                tools=[WEATHER, ADD], tool_choice=choice, max_tokens=120, temperature=1.0, seed=seed).choices[0]
            reason = "stop" if isinstance(choice, dict) else "tool_calls"      # named: "stop", as OpenAI answers
            assert whole.finish_reason == reason and whole.message.tool_calls and whole.message.content is None
            for call in whole.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
