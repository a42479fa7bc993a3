"""The OpenAI wire format: request models, their sampling parameters, response bodies, errors.

Only this module and ``ingress`` know about HTTP; the engine sees token ids and
``SamplingParams``. Parameters the engine cannot honour (best_of, suffix, and any field it
does not know) are refused with a 400 naming the parameter rather than silently ignored.
Structured output (response_format, vLLM's guided_*) becomes a ``grammar.GrammarSpec``; tools
are rendered by the chat template and their calls parsed back out of the output (``tool_calls``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mtpserve.engine.grammar import GrammarSpec
from mtpserve.engine.sampler import MAX_LOGPROBS, SamplingParams

MAX_N = 16


class APIError(Exception):
    """An error answered as OpenAI's envelope {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, None)


class _Strict(BaseModel):
    """A request body: strict types (true is not an integer and "7" not a token id, as JSON has
    it), and a field this server does not know is refused (400 naming it), never ignored; a field
    sent as null is one not sent."""
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, values):
        if isinstance(values, dict):
            return {k: v for k, v in values.items() if v is not None}
        return values


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send a last chunk with the request's usage.")


class JsonSchemaFormat(_Strict):
    name: str = Field(description="The schema's name.")
    description: str | None = None
    schema_: dict = Field(alias="schema", description="The JSON Schema the output must validate against.")
    strict: bool | None = Field(None, description="Accepted: the schema is always enforced.")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text (no constraint), json_object (any JSON object) or json_schema.")
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's newer form of the guided_* fields: one of them."""
    json_: dict | str | None = Field(None, alias="json", description="A JSON Schema the output must match.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF (xgrammar's dialect, rule `root`).")
    json_object: bool | None = Field(None, description="true: any JSON object.")


class _SamplingFields(_Strict):
    model: str | None = Field(None, description="The served model's name (see /v1/models); may be left out.")
    temperature: float | None = Field(None, description="0 = greedy; default 1.")
    top_p: float | None = Field(None, description="Nucleus mass in (0, 1]; default 1 (off).")
    top_k: int | None = Field(None, description="Keep the k most likely tokens; 0, -1 or null = off.")
    n: int = Field(1, description=f"Choices to generate per prompt (1..{MAX_N}).")
    stream: bool = Field(False, description="Stream Server-Sent Events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end generation.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    seed: int | None = Field(None, description="Seeds sampling; choice i of n uses seed + i.")
    ignore_eos: bool = Field(False, description="Keep going past the end-of-sequence token.")
    min_tokens: int = Field(0, description="vLLM's: EOS and stop_token_ids cannot end the output before this "
                                           "many tokens (stop strings still can).")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: keep the stop string that ended the "
                                                                "output in its text.")
    return_token_ids: bool = Field(False, description="vLLM's: each choice also carries `token_ids` (when "
                                                      "streaming, the chunk's new ones; a chunk is sent for every "
                                                      "step that adds tokens, even when their text is held back "
                                                      "as an incomplete UTF-8 sequence) and `prompt_token_ids` "
                                                      "(the first chunk's).")
    presence_penalty: float = Field(0.0, description="In [-2, 2]: subtracted from the logit of each token "
                                                     "already in the output.")
    frequency_penalty: float = Field(0.0, description="In [-2, 2]: subtracted from a token's logit per "
                                                      "occurrence in the output.")
    repetition_penalty: float = Field(1.0, description="vLLM's, > 0 (1 = off): logits of prompt and output "
                                                       "tokens divided by it (positive) or multiplied (negative).")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100], "
                                                                 "added to that logit.")
    min_p: float = Field(0.0, description="vLLM's, in [0, 1]: drop tokens less likely than min_p x the most likely.")
    user: str | None = None
    response_format: ResponseFormat | None = Field(None, description="Structured output: json_object or json_schema "
                                                                     "(enforced by a grammar, also with MTP).")
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON Schema the output must match.")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression the output must match.")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the output is exactly one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM's: an EBNF grammar (xgrammar's dialect, rule `root`) "
                                                         "the output must match.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: json, regex, choice, grammar "
                                                                           "or json_object, as the guided_* fields.")

    def refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in 1..{MAX_N}, got {self.n}", "n")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise bad_request("stream_options goes with stream: true", "stream_options")

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """The engine parameters of choice ``choice``; ValueError -> a 400."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise bad_request("stop takes at most 4 strings", "stop")
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=None if self.top_k in (None, -1) else self.top_k,
                seed=None if self.seed is None else self.seed + choice,
                max_tokens=max_tokens, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                min_p=self.min_p, logit_bias=self._logit_bias(), prompt_logprobs=self.num_prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=self.num_logprobs,
                grammar=self.grammar_spec())
        except ValueError as e:                    # the engine's messages start with its field's name
            name, _, rest = str(e).partition(" ")
            field = self._request_field(name)
            raise bad_request(f"{field} {rest}", field) from None

    def _request_field(self, name: str) -> str:
        """The request's field for a ``SamplingParams`` field's name (what a 400 names)."""
        return {"prompt_logprobs": "logprobs"}.get(name, name)

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's structured-output constraint (at most one of response_format, the
        guided_* fields and structured_outputs), or None; a 400 naming the field for a malformed one."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(_grammar("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request("response_format of type json_schema needs json_schema", "response_format")
            given.append(_grammar("json_schema", json.dumps(rf.json_schema.schema_), "response_format"))
        elif rf is not None and rf.json_schema is not None:
            raise bad_request("response_format.json_schema goes with type json_schema", "response_format")
        if self.guided_json is not None:
            given.append(_grammar("json_schema", _schema_text(self.guided_json, "guided_json"), "guided_json"))
        if self.guided_regex is not None:
            given.append(_grammar("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            if not self.guided_choice or not all(self.guided_choice):
                raise bad_request("guided_choice needs one or more non-empty strings", "guided_choice")
            given.append(_grammar("choice", json.dumps(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            given.append(_grammar("grammar", self.guided_grammar, "guided_grammar"))
        so = self.structured_outputs
        if so is not None:
            param = "structured_outputs"
            if so.json_ is not None:
                given.append(_grammar("json_schema", _schema_text(so.json_, param), param))
            if so.regex is not None:
                given.append(_grammar("regex", so.regex, param))
            if so.choice is not None:
                if not so.choice or not all(so.choice):
                    raise bad_request("structured_outputs.choice needs one or more non-empty strings", param)
                given.append(_grammar("choice", json.dumps(so.choice), param))
            if so.grammar is not None:
                given.append(_grammar("grammar", so.grammar, param))
            if so.json_object:
                given.append(_grammar("json_object", "", param))
            if not so.model_fields_set - {"json_object"} and not so.json_object:
                raise bad_request("structured_outputs needs one of json, regex, choice, grammar, json_object", param)
        given += self._tool_grammar()
        if len(given) > 1:
            raise bad_request(f"one structured-output constraint per request: {given[0].param} and "
                              f"{given[1].param} were both given", given[1].param)
        return given[0] if given else None

    def _tool_grammar(self) -> list[GrammarSpec]:
        """The grammar that forced tool calls need (chat's tool_choice required / named)."""
        return []

    def _logit_bias(self) -> tuple:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise bad_request(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
            pairs.append((int(key), bias))
        return tuple(pairs)

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token when logprobs are asked for, else None (see the subclasses)."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Completions with echo and logprobs score the prompt too."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists.")
    max_tokens: int | None = Field(16, description="Tokens to generate per choice (default 16).")
    logprobs: int | None = Field(None, description=f"Each token's log-probability and the N (0..{MAX_LOGPROBS}) "
                                                   f"most likely tokens' at its place, from the model's raw "
                                                   f"distribution (before temperature, top-k, top-p).")
    echo: bool = Field(False, description="Put the prompt before each choice's text (with logprobs: the prompt "
                                          "tokens' too, the first one's null).")
    best_of: int | None = Field(None, description="Only 1: ranking hidden candidates is not implemented.")
    suffix: str | None = Field(None, description="Not supported (the models served have no fill-in-the-middle format).")

    def prompts(self) -> list[str | list[int]]:
        if self.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported by this server: it would generate best_of hidden "
                              "candidates per choice and rank them by log-probability; ask for n choices with "
                              "logprobs and rank them yourself", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ToolCallFunction(_Strict):
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text.")


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's tool calls.")
    tool_call_id: str | None = Field(None, description="A tool turn's: the call it answers.")
    name: str | None = Field(None, description="A participant's name, given to the chat template as the message's "
                                               "`name`; a 400 with a template that does not render it (Qwen's).")

    def text(self, index: int = 0) -> str:
        """The content as one text (text parts joined); a 400 naming ``messages[index]...`` for a
        part that is not ``{"type": "text", "text": "..."}`` (images and the like are not
        supported; a key beside those two is refused, not ignored)."""
        if not isinstance(self.content, list):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            where = f"messages[{index}].content[{j}]"
            if part.get("type") != "text":
                raise bad_request(f"content parts of type {part.get('type')!r} are not supported "
                                  f"(only text)", f"{where}.type")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise bad_request(f"{where}.{extra[0]} is not a field this server supports (it refuses what it "
                                  f"would otherwise ignore)", f"{where}.{extra[0]}")
            if not isinstance(part.get("text"), str):
                raise bad_request("a text part needs its text, a string", f"{where}.text")
            parts.append(part["text"])
        return "".join(parts)

    def check_role_fields(self, index: int) -> None:
        """A 400 for a field the message's role does not have: tool_calls are an assistant's,
        tool_call_id a tool message's (which needs one)."""
        if self.tool_calls and self.role != "assistant":
            raise bad_request(f"tool_calls are an assistant message's, not a {self.role} message's",
                              f"messages[{index}].tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise bad_request("a tool message needs tool_call_id (the call it answers)",
                              f"messages[{index}].tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise bad_request(f"tool_call_id is a tool message's, not a {self.role} message's",
                              f"messages[{index}].tool_call_id")


class FunctionDefinition(_Strict):
    name: str = Field(description="The function's name (letters, digits, _ and -).")
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON Schema of its arguments (an object).")
    strict: bool | None = Field(None, description="Accepted: forced calls always follow the schema.")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(description="The conversation, rendered with the model's chat template.")
    max_tokens: int | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, description="Tokens to generate per choice "
                                              "(default: as many as the context and the KV cache allow).")
    logprobs: bool = Field(False, description="Each output token's log-probability (the model's raw distribution).")
    top_logprobs: int | None = Field(None, description=f"With logprobs: the N (0..{MAX_LOGPROBS}) most likely "
                                                       f"tokens at each place.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call, rendered by the chat template.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none (tools not offered), auto (the default with tools: calls parsed from the output), "
                          "required or a named function (the call forced by a grammar: arguments valid by schema).")
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one tool call (required forces an array of one; under auto only the "
                          "first call is returned); true, the default: any number.")

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def messages_as_dicts(self, renders_names: bool = True) -> list[dict]:
        return messages_as_dicts(self.messages, renders_names)

    def _request_field(self, name: str) -> str:
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if name == "logprobs" else name

    @property
    def tool_mode(self) -> str:
        """none (no tools offered), auto, required or named (see tool_choice); a 400 for a
        tool_choice that names no offered tool, or tools that are malformed."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            if self.parallel_tool_calls is not None:
                raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
            return "none"
        names = [t.function.name for t in self.tools]
        for name in names:
            if not TOOL_NAME.match(name):
                raise bad_request(f"tool names are 1-64 letters, digits, _ or -, got {name!r}", "tools")
        if len(set(names)) < len(names):
            raise bad_request("tool names must be unique", "tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                  "tool_choice")
            return "named"
        return choice or "auto"

    def tools_to_render(self) -> list[dict] | None:
        """The tools as the chat template takes them (none with tool_choice none)."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_schemas(self) -> dict[str, dict]:
        return {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or ()}

    def _tool_grammar(self) -> list[GrammarSpec]:
        mode = self.tool_mode
        if mode == "named":
            schema = self.tool_schemas()[self.tool_choice.function.name]
            return [_grammar("json_schema", json.dumps(schema), "tool_choice")]
        if mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, schema in self.tool_schemas().items()]
            array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if self.parallel_tool_calls is False:
                array["maxItems"] = 1
            return [_grammar("json_schema", json.dumps(array), "tools")]
        return []


def _grammar(kind: str, value: str, param: str) -> GrammarSpec:
    try:
        return GrammarSpec(kind, value, param)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def _schema_text(schema: dict | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{param} is not JSON", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema (an object)", param)
    return json.dumps(schema)


def messages_as_dicts(messages: list[ChatMessage] | None, renders_names: bool = True) -> list[dict]:
    """What the chat template renders (a tool call's arguments as an object, as Qwen's template
    writes them); a 400 for an empty conversation or arguments that are not a JSON object."""
    if not messages:
        raise bad_request("messages is empty", "messages")
    out = []
    for i, m in enumerate(messages):
        m.check_role_fields(i)
        d = {"role": m.role, "content": m.text(i)}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    arguments = json.loads(c.function.arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise bad_request(f"messages[{i}].tool_calls: arguments must be a JSON object's text",
                                      f"messages[{i}].tool_calls")
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": arguments}})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            if not renders_names:                  # refused, not dropped unseen
                raise bad_request("this model's chat template does not render a message's name",
                                  f"messages[{i}].name")
            d["name"] = m.name
        out.append(d)
    return out


TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, mode: str, named: str | None, tool_names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a chat answer's text (special tokens kept). auto: Qwen's
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the text before the
    first one the content; required: the JSON array of calls the grammar forced; named: the
    arguments object the grammar forced. Anything that does not parse stays content, no calls."""
    def call(name: str, arguments) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
    try:
        if mode == "named":
            arguments = json.loads(text)
            return (None, [call(named, arguments)]) if isinstance(arguments, dict) else (text, [])
        if mode == "required":
            items = json.loads(text)
        elif mode == "auto" and "<tool_call>" in text:
            items = [json.loads(b) for b in TOOL_CALL_BLOCK.findall(text)]
        else:
            return text, []
    except ValueError:
        return text, []
    if not isinstance(items, list) or not items or not all(
            isinstance(c, dict) and c.get("name") in tool_names and isinstance(c.get("arguments"), dict) for c in items):
        return text, []
    content = text.split("<tool_call>", 1)[0].strip() if mode == "auto" else ""
    return content or None, [call(c["name"], c["arguments"]) for c in items]


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's shape): a prompt, or messages rendered with the chat template."""
    model: str | None = Field(None, description="The served model's name; may be left out.")
    prompt: str | None = Field(None, description="Text to tokenize (or give messages).")
    messages: list[ChatMessage] | None = Field(None, description="A conversation, rendered as chat completions do.")
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant's turn opening.")


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape)."""
    model: str | None = Field(None, description="The served model's name; may be left out.")
    tokens: list[int] = Field(description="Token ids to turn into text.")


# ---------------------------------------------------------------------------- response bodies
def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from
    the prefix cache."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion_body(request_id: str, model: str, texts: list[str | None], finish: list[str], usage_: dict,
                    chat: bool, token_ids: list[list[int]] | None = None,
                    prompt_token_ids: list[list[int]] | None = None, logprobs: list[dict] | None = None,
                    tool_calls: list[list[dict]] | None = None) -> dict:
    """The non-streamed answer; ``token_ids`` / ``prompt_token_ids`` per choice with
    return_token_ids, ``logprobs`` per choice when asked for, ``tool_calls`` per chat choice
    (its message's, when it has any)."""
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finish))]
        for choice, calls in zip(choices, tool_calls or ()):
            if calls:
                choice["message"]["tool_calls"] = calls
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                   for i, (t, f) in enumerate(zip(texts, finish))]
    if logprobs is not None:
        for choice, lp in zip(choices, logprobs):
            choice["logprobs"] = lp
    if token_ids is not None:
        for choice, ids, prompt_ids in zip(choices, token_ids, prompt_token_ids):
            choice["token_ids"], choice["prompt_token_ids"] = ids, prompt_ids
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage_}


def completion_logprobs(entries: list, token_text, text_offset: int) -> dict:
    """A completions choice's ``logprobs`` for engine entries (id, logprob, top); offsets count
    from ``text_offset`` in the choice's text."""
    tokens = [token_text(t) for t, _, _ in entries]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(a): b for a, b in top} for _, _, top in entries], "text_offset": offsets}


def echo_logprobs(first_token: int, entries: list, token_text) -> dict:
    """The prompt's part of an echoed completion's ``logprobs``: its first token has none."""
    scored = completion_logprobs(entries, token_text, len(token_text(first_token)))
    return {"tokens": [token_text(first_token)] + scored["tokens"],
            "token_logprobs": [None] + scored["token_logprobs"], "top_logprobs": [None] + scored["top_logprobs"],
            "text_offset": [0] + scored["text_offset"]}


def joined_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: list, token_text, token_bytes) -> dict:
    """A chat choice's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}; ``bytes``
    are the token's own (``token_bytes``), also for part of a character, whose ``token`` text is
    U+FFFD: a client joins the bytes of consecutive tokens to rebuild it."""
    def one(t, lp):
        return {"token": token_text(t), "logprob": lp, "bytes": list(token_bytes(t))}
    return {"content": [{**one(t, lp), "top_logprobs": [one(a, b) for a, b in top]} for t, lp, top in entries]}


class SSEChunks:
    """One response's stream chunks: ``data: {"id": ..., "choices": [...], "usage": ...}`` lines,
    the fields every chunk repeats encoded once (each chunk then encodes only its choices: half
    the time of the whole body, on a path that runs once per token per stream)."""

    _encode = json.JSONEncoder(separators=(",", ":")).encode

    def __init__(self, request_id: str, model: str, created: int, chat: bool, include_usage: bool):
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model}
        self._head = f"data: {self._encode(head)[:-1]},\"choices\":"
        self._tail = ',"usage":null}\n\n' if include_usage else "}\n\n"

    def chunk(self, choices: list[dict]) -> str:
        return f"{self._head}{self._encode(choices)}{self._tail}"

    def usage_chunk(self, usage_: dict) -> str:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        return f"{self._head}[],\"usage\":{self._encode(usage_)}}}\n\n"


def chunk_choice(index: int, text: str | None, finish_reason: str | None, chat: bool,
                 first: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    delta = {} if text is None else {"content": text}
    if first:
        delta = {"role": "assistant", "content": text or ""}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def split_at_tool_call(token_ids: list[int], text: str, call_token: int, decode) -> tuple[str, str]:
    """A streamed step's text split where a tool call starts: (the part before the ``<tool_call>``
    token, sent as content; the rest, held back). When the text of the tokens before it is not
    a prefix of the step's text (a character split across steps), all of it is held."""
    before = decode(token_ids[:token_ids.index(call_token)])
    if not text.startswith(before):
        before = ""
    return before, text[len(before):]


def tool_call_deltas(calls: list[dict]) -> list[dict]:
    """A streamed chat chunk's ``delta.tool_calls``: each call whole, with its index."""
    return [{"index": k, **c} for k, c in enumerate(calls)]


SSE_DONE = "data: [DONE]\n\n"
