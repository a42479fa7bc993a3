"""The OpenAI wire format: request models, their sampling parameters, response bodies, errors.

Only this module and ``ingress`` know about HTTP; the engine sees token ids and
``SamplingParams``. Parameters the engine cannot honour (echo, best_of, suffix, and any field
it does not know) are refused with a 400 naming the parameter rather
than silently ignored.
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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

    def refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in 1..{MAX_N}, got {self.n}", "n")

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
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=self.num_logprobs)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None

    def _logit_bias(self) -> tuple:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
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
    best_of: int | None = Field(None, description="Not supported.")
    suffix: str | None = Field(None, description="Not supported.")

    def prompts(self) -> list[str | list[int]]:
        if self.best_of not in (None, 1) or self.suffix:
            raise bad_request("best_of and suffix are not supported by this server",
                              "suffix" if self.suffix else "best_of")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise bad_request(f"content parts of type {part.get('type')!r} are not supported", "messages")
                parts.append(part.get("text", ""))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(description="The conversation, rendered with the model's chat template.")
    max_tokens: int | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, description="Tokens to generate per choice "
                                              "(default: as many as the context and the KV cache allow).")
    logprobs: bool = Field(False, description="Each output token's log-probability (the model's raw distribution).")
    top_logprobs: int | None = Field(None, description=f"With logprobs: the N (0..{MAX_LOGPROBS}) most likely "
                                                       f"tokens at each place.")

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def messages_as_dicts(self) -> list[dict]:
        return messages_as_dicts(self.messages)


def messages_as_dicts(messages: list[ChatMessage] | None) -> list[dict]:
    """What the chat template renders; a 400 for an empty conversation."""
    if not messages:
        raise bad_request("messages is empty", "messages")
    return [{"role": m.role, "content": m.text()} for m in messages]


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


def completion_body(request_id: str, model: str, texts: list[str], finish: list[str], usage_: dict,
                    chat: bool, token_ids: list[list[int]] | None = None,
                    prompt_token_ids: list[list[int]] | None = None, logprobs: list[dict] | None = None) -> dict:
    """The non-streamed answer; ``token_ids`` / ``prompt_token_ids`` per choice with
    return_token_ids, ``logprobs`` per choice when asked for."""
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finish))]
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


def chat_logprobs(entries: list, token_text) -> dict:
    """A chat choice's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def one(t, lp):
        text = token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(t, lp), "top_logprobs": [one(a, b) for a, b in top]} for t, lp, top in entries]}


def sse_chunk(request_id: str, model: str, created: int, chat: bool, choices: list[dict],
              include_usage: bool, usage_: dict | None = None) -> str:
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": choices}
    if include_usage:
        body["usage"] = usage_
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def chunk_choice(index: int, text: str | None, finish_reason: str | None, chat: bool,
                 first: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    delta = {} if text is None else {"content": text}
    if first:
        delta = {"role": "assistant", "content": text or ""}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


SSE_DONE = "data: [DONE]\n\n"
