"""The OpenAI request models' structured-output and tool rules, and tool-call parsing (no server)."""
from __future__ import annotations

import json

import pytest

from mtpserve.actors.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_tool_calls,
    split_at_tool_call,
)
from mtpserve.engine.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMES = {"get_weather", "add"}


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_auto_parses_qwen_tool_call_blocks_and_keeps_the_text_before_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = parse_tool_calls(text, "auto", None, NAMES)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',     # broken JSON
    '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',                   # not a tool offered
    '<tool_call>\n{"name": "add", "arguments": "1, 2"}\n</tool_call>',                      # arguments not an object
])
def test_auto_leaves_what_does_not_parse_as_content(text):
    assert parse_tool_calls(text, "auto", None, NAMES) == (text, [])


def test_a_streamed_step_is_split_where_its_tool_call_starts(model_dir):
    tok = Tokenizer(model_dir)
    call = tok.token_id("<tool_call>")
    ids = tok.encode("Sure.") + [call] + tok.encode('\n{"name": "add"')
    text = tok.decode(ids)                                   # the step's text, <tool_call> skipped
    assert split_at_tool_call(ids, text, call, tok.decode) == ("Sure.", '\n{"name": "add"')
    assert split_at_tool_call([call, *ids[-2:]], tok.decode(ids[-2:]), call, tok.decode) == ("", tok.decode(ids[-2:]))
    assert split_at_tool_call(ids, "\ufffd" + text, call, tok.decode) == ("", "\ufffd" + text)   # not a prefix: all held


def test_forced_outputs_parse_as_calls():
    content, calls = parse_tool_calls('{"city": "Oslo"}', "named", "get_weather", NAMES)
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    content, calls = parse_tool_calls('[{"name": "add", "arguments": {"a": 1}}]', "required", None, NAMES)
    assert content is None and calls[0]["function"]["name"] == "add"
    truncated = '[{"name": "add", "argu'                          # cut by max_tokens
    assert parse_tool_calls(truncated, "required", None, NAMES) == (truncated, [])
    assert parse_tool_calls("<tool_call>{}</tool_call>", "none", None, NAMES)[1] == []


def test_tool_choice_modes_and_their_grammars():
    assert _chat().tool_mode == "none" and _chat(tools=[WEATHER]).tool_mode == "auto"
    assert _chat(tools=[WEATHER], tool_choice="none").tools_to_render() is None
    assert _chat(tools=[WEATHER]).grammar_spec() is None                 # auto: nothing forced
    named = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_mode == "named" and json.loads(named.grammar_spec().value) == WEATHER["function"]["parameters"]
    required = json.loads(_chat(tools=[WEATHER], tool_choice="required").grammar_spec().value)
    assert required["minItems"] == 1 and required["items"]["properties"]["name"] == {"const": "get_weather"}
    for kw, param in (({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
                      ({"tools": [WEATHER, WEATHER]}, "tools"),
                      ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tools")):
        with pytest.raises(APIError) as e:
            _chat(**kw).grammar_spec()
        assert e.value.param == param, kw


def test_structured_output_fields_become_one_grammar_or_a_400_naming_the_field():
    schema = {"type": "object"}
    rf = CompletionRequest(prompt="x", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert rf.grammar_spec().kind == "json_schema" and json.loads(rf.grammar_spec().value) == schema
    assert CompletionRequest(prompt="x", response_format={"type": "text"}).grammar_spec() is None
    assert CompletionRequest(prompt="x", guided_json='{"type": "integer"}').grammar_spec().param == "guided_json"
    assert CompletionRequest(prompt="x", guided_choice=["a", "b"]).grammar_spec().kind == "choice"
    so = CompletionRequest(prompt="x", structured_outputs={"json": {"type": "object"}}).grammar_spec()
    assert (so.kind, so.param) == ("json_schema", "structured_outputs")
    assert CompletionRequest(prompt="x", structured_outputs={"choice": ["a"]}).grammar_spec().kind == "choice"
    assert CompletionRequest(prompt="x", structured_outputs={"json_object": True}).grammar_spec().kind == "json_object"
    for kw, param in (({"structured_outputs": {}}, "structured_outputs"),
                      ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                      ({"guided_json": "not json"}, "guided_json"), ({"guided_json": "[1]"}, "guided_json"),
                      ({"guided_choice": []}, "guided_choice"), ({"guided_regex": "a", "guided_grammar": "b"}, "guided_grammar"),
                      ({"response_format": {"type": "json_schema"}}, "response_format"),
                      ({"guided_regex": "a" * 70000}, "guided_regex")):
        with pytest.raises(APIError) as e:
            CompletionRequest(prompt="x", **kw).grammar_spec()
        assert e.value.status == 400 and e.value.param == param, kw


def test_tool_turns_render_through_the_bundled_template(model_dir):
    tok = Tokenizer(model_dir)
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=[WEATHER])
    text = tok.apply_chat_template(body.messages_as_dicts(), tools=body.tools_to_render())
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert json.dumps(WEATHER) in text
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(plain) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                                            "<|im_start|>assistant\n"
    bad = ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(APIError) as e:
        bad.messages_as_dicts()
    assert e.value.param == "messages[0].tool_calls"


def test_parallel_tool_calls_false_allows_one_call(model_dir):
    """parallel_tool_calls false: required's grammar is an array of at most one call, and under
    auto only the first parsed call is answered (the model cannot be held to one there)."""
    from types import SimpleNamespace

    from mtpserve.actors.ingress import OpenAIRoutes
    ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    for parallel, most in ((None, None), (True, None), (False, 1)):
        array = json.loads(_chat(tools=[WEATHER, ADD], tool_choice="required",
                                 parallel_tool_calls=parallel).grammar_spec().value)
        assert array.get("maxItems") == most and array["minItems"] == 1
    tok = Tokenizer(model_dir)
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    routes = SimpleNamespace(manifest=SimpleNamespace(eos_token_ids=()), tokenizer=tok)
    for parallel, names in ((None, ["get_weather", "add"]), (False, ["get_weather"])):
        body = _chat(tools=[WEATHER, ADD], parallel_tool_calls=parallel)
        _, calls, reason = OpenAIRoutes._tool_answer(routes, body, text, tok.encode(text), "stop")
        assert [c["function"]["name"] for c in calls] == names and reason == "tool_calls"
    # OpenAI's finish_reason: "stop" under a named tool_choice, a length cut stays "length"
    named = _chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    one = '{"city": "Paris"}'                             # what a named choice's grammar forces: the arguments
    _, calls, reason = OpenAIRoutes._tool_answer(routes, named, one, tok.encode(one), "stop")
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and reason == "stop"
    _, _, reason = OpenAIRoutes._tool_answer(routes, _chat(tools=[WEATHER, ADD]), text, tok.encode(text), "length")
    assert reason == "length"


def _refused(build, param: str) -> str:
    """The 400 that ``build()`` raises, checked to name ``param``; its message."""
    with pytest.raises(APIError) as e:
        build()
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value.message


@pytest.mark.parametrize("part,param", [
    ({"type": "text", "text": 5}, "messages[1].content[0].text"),
    ({"type": "text", "text": None}, "messages[1].content[0].text"),
    ({"type": "text", "text": ["a"]}, "messages[1].content[0].text"),
    ({"type": "text"}, "messages[1].content[0].text"),
    ({"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, "messages[1].content[0].cache_control"),
    ({"type": "image_url", "image_url": {"url": "http://x"}}, "messages[1].content[0].type"),
])
def test_a_malformed_content_part_is_a_400_naming_it(part, param):
    """Each part is {"type": "text", "text": str}: anything else is refused by name (a text that
    was not a string crashed the join: a 500; a key beside them was ignored)."""
    req = ChatCompletionRequest(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [part]}])
    _refused(req.messages_as_dicts, param)
    ok = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}])
    assert ok.messages_as_dicts()[0]["content"] == "ab"


def test_fields_of_another_role_are_refused_by_name():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases = [([{"role": "user", "content": "x", "tool_calls": [call]}], "messages[0].tool_calls"),
             ([{"role": "user", "content": "x"}, {"role": "tool", "content": "5"}], "messages[1].tool_call_id"),
             ([{"role": "user", "content": "x", "tool_call_id": "c1"}], "messages[0].tool_call_id")]
    for messages, param in cases:
        _refused(ChatCompletionRequest(messages=messages).messages_as_dicts, param)
    fine = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    assert [m["role"] for m in ChatCompletionRequest(messages=fine).messages_as_dicts()] == ["user", "assistant", "tool"]


def test_options_without_what_they_modify_are_refused():
    _refused(lambda: _chat(stream_options={"include_usage": True}).refuse_unsupported(), "stream_options")
    _chat(stream=True, stream_options={"include_usage": True}).refuse_unsupported()
    _chat(stream_options={}).refuse_unsupported()          # nothing asked (vLLM's rule: refused when it asks)
    _refused(lambda: _chat(parallel_tool_calls=False).tool_mode, "parallel_tool_calls")
    assert _chat(parallel_tool_calls=False, tools=[WEATHER]).tool_mode == "auto"


def test_a_bad_sampling_value_names_the_field_the_request_sent():
    """The engine's check names its own field (max_tokens, logprobs): the 400 names the request's."""
    message = _refused(lambda: _chat(max_completion_tokens=0).sampling_params(0, 0), "max_completion_tokens")
    assert message.startswith("max_completion_tokens ")
    _refused(lambda: _chat(max_tokens=0).sampling_params(0, 0), "max_tokens")
    assert _refused(lambda: _chat(logprobs=True, top_logprobs=21).sampling_params(4, 0),
                    "top_logprobs").startswith("top_logprobs ")
    _refused(lambda: CompletionRequest(prompt="x", logprobs=21).sampling_params(4, 0), "logprobs")
    _refused(lambda: CompletionRequest(prompt="x", logprobs=21, echo=True).sampling_params(4, 0), "logprobs")
    for key in ("\u00b2", "-1", "x", "1.5", "\u0661"):        # superscript two and Arabic-Indic one are digits to str
        _refused(lambda key=key: _chat(logit_bias={key: 1.0}).sampling_params(4, 0), "logit_bias")
    assert _chat(logit_bias={"42": 1.0}).sampling_params(4, 0).logit_bias == ((42, 1.0),)


def test_chat_logprobs_bytes_are_each_tokens_own_bytes(model_dir):
    """OpenAI's ``bytes``: a client joins those of consecutive tokens to rebuild a character that
    several tokens share (each of them decodes alone to U+FFFD)."""
    from mtpserve.actors.protocol import chat_logprobs
    tok = Tokenizer(model_dir)
    text = "é 漢字 🙂 x"
    ids = tok.encode(text)
    entries = [(t, -0.5, [(t, -0.5)]) for t in ids]
    content = chat_logprobs(entries, lambda t: tok.decode([t], skip_special_tokens=False), tok.token_bytes)["content"]
    assert any(e["token"] == "\ufffd" for e in content), "the text has characters split over tokens"
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == text
    assert all(e["bytes"] == e["top_logprobs"][0]["bytes"] for e in content)
    end = tok.token_id("<|im_end|>")
    assert tok.token_bytes(end) == b"<|im_end|>"


def test_a_messages_name_reaches_the_chat_template_or_is_refused(model_dir):
    """OpenAI's ``name`` on a message (LangChain sends it) goes to a template that renders it, and
    is refused by name where the template would drop it unseen (the bundled one, as Qwen's)."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": "ada"}])
    assert req.messages_as_dicts() == [{"role": "user", "content": "hi", "name": "ada"}]
    _refused(lambda: req.messages_as_dicts(renders_names=False), "messages[0].name")
    assert not Tokenizer(model_dir).renders_names
