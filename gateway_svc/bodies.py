"""The bodies the OpenAI-compatible endpoints take, as pydantic models: OpenAI's fields
and the vLLM extras iserve serves, each with the limits its gRPC field carries, and the
fields whose effect iserve does not have, refused (400 naming the field) unless they
carry their neutral value. FastAPI validates every request against them and publishes
them in the OpenAPI document, so the document and the checks cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from services.proto_limits import UINT32_MAX, UINT64_MAX
from services.stop_strings import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    check_stop_strings,
    check_stop_token_ids,
)

# Strict: a field takes its own JSON type only. pydantic's lax mode would take "5" and
# true as max_tokens 5 and 1, "yes" as stream true, "0.5" as a temperature: what the
# document calls invalid (and OpenAI refuses), taken and guessed at. JSON's 7.0 is still
# the integer 7, as JSON Schema counts it (:func:`_integral`).
_STRICT = ConfigDict(strict=True)


def _integral(value: Any) -> Any:
    """An integral float (JSON's 7.0) as the integer it is; anything else as it came."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


# OpenAI's default max_tokens of /v1/completions.
COMPLETION_MAX_TOKENS = 16
_STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
            "maxItems": MAX_STOP_STRINGS,
        },
        {"type": "null"},
    ]
}
# Absent, null, false or 0: a request for log-probabilities is refused.
_NO_LOGPROBS = {"anyOf": [{"const": False}, {"const": 0}, {"type": "null"}]}
# A completion's logprobs is a count of alternatives beside the sampled token's, so 0
# asks for log-probabilities too.
_NO_COMPLETION_LOGPROBS = {"anyOf": [{"const": False}, {"type": "null"}]}
# OpenAI refuses stream_options without a stream: the body's schema takes stream true,
# or no stream_options.
_STREAM_OPTIONS_IF_STREAMED = {
    "anyOf": [
        {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        {"properties": {"stream_options": {"type": "null"}}},
    ]
}
# An OpenAI text content part; the validator refuses any other kind by name.
_TEXT_PARTS = WithJsonSchema(
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "required": ["type", "text"],
        },
    }
)


_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": UINT32_MAX}
_STOP_TOKEN_IDS = WithJsonSchema(
    {
        "anyOf": [
            {"type": "array", "items": _TOKEN_ID, "maxItems": MAX_STOP_TOKEN_IDS},
            {"type": "null"},
        ]
    }
)


def _token_ids(values: list[Any]) -> list[int] | None:
    """``values`` as token ids, or None when they are not all integers in uint32's range
    (JSON's 7.0 is the integer 7, as JSON Schema counts it)."""
    # All plain integers in range, checked by C loops: the loop below held the event
    # loop for a second over a 32 MiB list of ids.
    if set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= UINT32_MAX:
        return values
    ids = []
    for value in values:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT32_MAX:
            return None
        ids.append(value)
    return ids


# OpenAI's (and vLLM's) fields whose effect this server does not have. Ignored, they
# would change the answer in silence (a penalty not applied, JSON not enforced, a tool
# never offered), so any value but the neutral one is a 400 naming the field; the
# document says the same.
def _is_number(value: Any, number: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value == number


_Declined = dict[str, tuple[Callable[[Any], bool], list[dict[str, Any]], str]]
# name: (whether a value is the neutral one, the neutral values' JSON schema, what is
# not supported)
_DECLINED: _Declined = {
    "frequency_penalty": (lambda v: _is_number(v, 0), [{"const": 0}], "frequency penalties are"),
    "presence_penalty": (lambda v: _is_number(v, 0), [{"const": 0}], "presence penalties are"),
    "logit_bias": (lambda v: v == {}, [{"type": "object", "maxProperties": 0}], "logit biases are"),
    # vLLM's extras, which clients written for vLLM send.
    "repetition_penalty": (
        lambda v: _is_number(v, 1),
        [{"const": 1}],
        "repetition penalties are",
    ),
    "min_p": (lambda v: _is_number(v, 0), [{"const": 0}], "min_p is"),
    "min_tokens": (lambda v: _is_number(v, 0), [{"const": 0}], "min_tokens is"),
    "use_beam_search": (lambda v: v is False, [{"const": False}], "beam search is"),
    "length_penalty": (
        lambda v: _is_number(v, 1),
        [{"const": 1}],
        "length penalties (of beam search) are",
    ),
    "bad_words": (lambda v: v == [], [{"type": "array", "maxItems": 0}], "bad_words is"),
    # An empty list allows no token (vLLM refuses it): only null is neutral.
    "allowed_token_ids": (lambda v: False, [], "allowed_token_ids is"),
    "guided_json": (lambda v: False, [], "guided decoding is"),
    "guided_regex": (lambda v: False, [], "guided decoding is"),
    "guided_choice": (lambda v: False, [], "guided decoding is"),
    "guided_grammar": (lambda v: False, [], "guided decoding is"),
    "include_stop_str_in_output": (
        lambda v: v is False,
        [{"const": False}],
        "include_stop_str_in_output is",
    ),
    # The workers' detokenizers always skip them (monitor_agent/engine/detokenizer.py).
    "skip_special_tokens": (
        lambda v: v is True,
        [{"const": True}],
        "special tokens in the output (skip_special_tokens: false) are",
    ),
    # 0 asks for the prompt tokens' own log-probabilities: only null is neutral.
    "prompt_logprobs": (lambda v: False, [], "prompt log-probabilities are"),
    # vLLM's newer name for guided decoding.
    "structured_outputs": (lambda v: False, [], "structured outputs (guided decoding) are"),
    "logits_processors": (
        lambda v: v == [],
        [{"type": "array", "maxItems": 0}],
        "logits processors are",
    ),
    "truncate_prompt_tokens": (lambda v: False, [], "truncate_prompt_tokens is"),
    # The prompt repeated in the answer.
    "echo": (lambda v: v is False, [{"const": False}], "echo is"),
    # OpenAI's on chats; vLLM takes it on completions too (structured output there).
    "response_format": (
        lambda v: isinstance(v, dict) and v.get("type") == "text",
        [{"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]}],
        "response formats other than text (JSON mode, JSON schemas) are",
    ),
}
_DECLINED_CHAT: _Declined = {
    "tools": (lambda v: v == [], [{"type": "array", "maxItems": 0}], "tool calling is"),
    # With no tools, "required" or a named function cannot be met: OpenAI answers 400.
    "tool_choice": (
        lambda v: v in ("none", "auto"),
        [{"enum": ["none", "auto"]}],
        "tool calling is",
    ),
    "functions": (lambda v: v == [], [{"type": "array", "maxItems": 0}], "function calling is"),
    "function_call": (
        lambda v: v in ("none", "auto"),
        [{"enum": ["none", "auto"]}],
        "function calling is",
    ),
    "modalities": (
        lambda v: v == ["text"],
        [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}],
        "output modalities other than text are",
    ),
    "audio": (lambda v: False, [], "audio output is"),
    # vLLM's: the reply continues the last (assistant) message instead of starting one.
    "continue_final_message": (
        lambda v: v is False,
        [{"const": False}],
        "continue_final_message is",
    ),
    # vLLM's: documents a retrieval template (Command R's) lays out; they never reached
    # the template here.
    "documents": (lambda v: v == [], [{"type": "array", "maxItems": 0}], "documents are"),
    # vLLM's: a template of the request's own instead of the model's.
    "chat_template": (lambda v: False, [], "a chat template of the request's own is"),
    # OpenAI's.
    "web_search_options": (lambda v: False, [], "web search is"),
    "verbosity": (lambda v: False, [], "verbosity is"),
}
_DECLINED_COMPLETION: _Declined = {
    "suffix": (lambda v: v == "", [{"type": "string", "maxLength": 0}], "suffixes are"),
    "best_of": (lambda v: _is_number(v, 1), [{"const": 1}], "best_of other than 1 is"),
}


_ALL_DECLINED: _Declined = {**_DECLINED, **_DECLINED_CHAT, **_DECLINED_COMPLETION}


def _declined(declined: _Declined, name: str) -> Any:
    """The field of a declined parameter: null by default, documented by its neutral
    values."""
    schema = declined[name][1]
    return Field(default=None, json_schema_extra={"anyOf": [*schema, {"type": "null"}]})


class GenerationBody(BaseModel):
    """Fields both endpoints share (OpenAI's names), plus iserve's ``priority`` and
    ``deadline_ms`` and vLLM's ``ignore_eos``, ``top_k`` and ``stop_token_ids``. Unknown
    fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(
        strict=True, extra="ignore", json_schema_extra=_STREAM_OPTIONS_IF_STREAMED
    )

    model: str = Field(min_length=1)
    # GenerateRequest carries max_tokens and deadline_ms as uint32 and the seed as uint64:
    # a larger number is a 400 here, not a failed message build (a 500).
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    # OpenAI's newer name for it: given, it is the limit, on both endpoints (completions
    # ignored it, and generated 16 tokens).
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    # OpenAI's nullable fields: null is the default (clients send None for "not set").
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    # OpenAI takes 0 to 1: 0 keeps only the likeliest token (served greedy, as the
    # request's proto3 0 would read as unset).
    top_p: float | None = Field(default=1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    # OpenAI's seed is an int64: a negative one is its 64-bit pattern (still reproducible).
    seed: int | None = Field(default=None, ge=-(2**63), le=UINT64_MAX)
    # The validators below give the clear messages; the json_schema_extra say the same
    # in the OpenAPI document, so that a request it calls valid is one the gateway takes.
    stop: str | list[str] | None = Field(default=None, json_schema_extra=_STOP_SCHEMA)
    n: int | None = Field(default=1, json_schema_extra={"anyOf": [{"const": 1}, {"type": "null"}]})
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: bool = False
    deadline_ms: int = Field(default=0, ge=0, le=UINT32_MAX)
    # vLLM's extras: generate max_tokens even past the end-of-sequence token; sample among
    # the top_k likeliest tokens (0, or vLLM's -1: all); end the generation at any of
    # stop_token_ids too. SamplingParams carries both as uint32.
    ignore_eos: bool = False
    top_k: int | None = Field(default=0, ge=-1, le=UINT32_MAX)
    stop_token_ids: Annotated[Any, _STOP_TOKEN_IDS] = None
    # Asked for, they would be answered with nothing: the workers do not return
    # log-probabilities, so a request for them is refused rather than given null.
    logprobs: bool | int | None = Field(default=None, json_schema_extra=_NO_LOGPROBS)
    top_logprobs: bool | int | None = Field(default=None, json_schema_extra=_NO_LOGPROBS)
    frequency_penalty: Any = _declined(_DECLINED, "frequency_penalty")
    presence_penalty: Any = _declined(_DECLINED, "presence_penalty")
    logit_bias: Any = _declined(_DECLINED, "logit_bias")
    repetition_penalty: Any = _declined(_DECLINED, "repetition_penalty")
    min_p: Any = _declined(_DECLINED, "min_p")
    min_tokens: Any = _declined(_DECLINED, "min_tokens")
    use_beam_search: Any = _declined(_DECLINED, "use_beam_search")
    length_penalty: Any = _declined(_DECLINED, "length_penalty")
    bad_words: Any = _declined(_DECLINED, "bad_words")
    allowed_token_ids: Any = _declined(_DECLINED, "allowed_token_ids")
    guided_json: Any = _declined(_DECLINED, "guided_json")
    guided_regex: Any = _declined(_DECLINED, "guided_regex")
    guided_choice: Any = _declined(_DECLINED, "guided_choice")
    guided_grammar: Any = _declined(_DECLINED, "guided_grammar")
    include_stop_str_in_output: Any = _declined(_DECLINED, "include_stop_str_in_output")
    skip_special_tokens: Any = _declined(_DECLINED, "skip_special_tokens")
    prompt_logprobs: Any = _declined(_DECLINED, "prompt_logprobs")
    structured_outputs: Any = _declined(_DECLINED, "structured_outputs")
    logits_processors: Any = _declined(_DECLINED, "logits_processors")
    truncate_prompt_tokens: Any = _declined(_DECLINED, "truncate_prompt_tokens")
    echo: Any = _declined(_DECLINED, "echo")
    response_format: Any = _declined(_DECLINED, "response_format")

    # Also the endpoints' own declined fields (check_fields=False: they are declared in
    # the subclasses).
    @field_validator(*_ALL_DECLINED, check_fields=False)
    @classmethod
    def _refuse_declined(cls, value: Any, info: ValidationInfo) -> Any:
        neutral, _schema, what = _ALL_DECLINED[info.field_name]
        if value is not None and not neutral(value):
            raise ValueError(f"{what} not supported by this server")
        return value

    @field_validator(
        "max_tokens",
        "max_completion_tokens",
        "seed",
        "n",
        "deadline_ms",
        "top_k",
        "logprobs",
        "top_logprobs",
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _integers(cls, value: Any) -> Any:
        return _integral(value)

    @model_validator(mode="after")
    def _newer_name(self) -> GenerationBody:
        """max_completion_tokens, given, is the limit: max_tokens from here on."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
            self.model_fields_set.add("max_tokens")
        return self

    # Also the endpoints' add_generation_prompt and add_special_tokens (check_fields=False:
    # declared there).
    @field_validator(
        "temperature",
        "top_p",
        "n",
        "stream",
        "add_generation_prompt",
        "add_special_tokens",
        check_fields=False,
    )
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value:  # true, or a positive count (the completions endpoint's form)
            raise ValueError("log-probabilities are not supported by this server")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_with_a_stream(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # A stream that failed validation is not in info.data: it has its own error.
        if options is not None and info.data.get("stream") is False:
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_a_number(cls, top_k: Any) -> Any:
        """JSON's true and "3" are no count of tokens (pydantic's lax ints would take
        them as 1 and 3); 3.0 is 3, as for stop_token_ids."""
        if isinstance(top_k, bool | str):
            raise ValueError("top_k takes an integer from -1 to 2^32-1")
        return top_k

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, top_k: int | None) -> int:
        """vLLM's -1 and null as the engine's 0: all tokens."""
        return max(top_k or 0, 0)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, values: Any) -> list[int] | None:
        if isinstance(values, list):
            check_stop_token_ids(values)  # before the ids are read one by one
        ids = _token_ids(values) if isinstance(values, list) else None
        if values is not None and ids is None:
            raise ValueError("stop_token_ids takes token ids (integers from 0 to 2^32-1)")
        return ids

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        try:
            check_stop_strings(tuple(stops))  # the worker's rule, said the gateway's way
        except ValueError:
            raise ValueError(
                f"stop takes up to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters"
            ) from None
        return stop

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


# The most prompts one completions request may list: each is a generation of its own,
# queued as a request (LangChain's legacy OpenAI LLM sends up to 20 at a time).
MAX_PROMPTS = 32

# OpenAI's four forms of a completion prompt: text, token ids, and a list of either
# (a choice per prompt, ``index`` its place in the list). An empty prompt gives the
# model nothing to continue: the scheduler refuses it too.
_PROMPT = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": _TOKEN_ID, "minItems": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": MAX_PROMPTS,
            },
            {
                "type": "array",
                "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                "minItems": 1,
                "maxItems": MAX_PROMPTS,
            },
        ]
    }
)


class CompletionBody(GenerationBody):
    prompt: Annotated[Any, _PROMPT]
    # OpenAI's default, absent or null. (A chat without max_tokens generates up to the
    # deployment's max_output_tokens: the scheduler reads an unset max_tokens so.)
    max_tokens: int | None = Field(default=COMPLETION_MAX_TOKENS, ge=1, le=UINT32_MAX)
    logprobs: bool | int | None = Field(default=None, json_schema_extra=_NO_COMPLETION_LOGPROBS)

    suffix: Any = _declined(_DECLINED_COMPLETION, "suffix")
    best_of: Any = _declined(_DECLINED_COMPLETION, "best_of")
    # vLLM's: whether the tokenizer adds the special tokens it adds to a text (BOS) to a
    # text prompt (a prompt of token ids is taken as it is).
    add_special_tokens: bool | None = True

    @property
    def max_tokens_given(self) -> bool:
        """Whether the client set max_tokens (null counts as unset). The default of 16
        goes as GenerateRequest.max_tokens_default, which a deployment allowing fewer
        output tokens caps instead of refusing."""
        return "max_tokens" in self.model_fields_set and self.max_tokens is not None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs_count(cls, logprobs: bool | int | None) -> bool | None:
        # 0 too: OpenAI and vLLM answer it with the sampled token's log-probability.
        if not isinstance(logprobs, bool | None):
            raise ValueError("log-probabilities are not supported by this server")
        return logprobs

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        """Every prompt, as text or token ids, in the order given."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            # A list of prompts (texts, or token id lists): a choice for each.
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(
                    f"at most {MAX_PROMPTS} prompts per request, got a list of {len(prompt)}"
                )
            if len({type(p) for p in prompt}) > 1:
                # The schema's forms are a list of texts or a list of token id lists; a
                # mix was served though the OpenAPI document calls it invalid (a tester).
                raise ValueError("a list of prompts holds texts or token id lists, not both")
            return [_one_prompt(p) for p in prompt]
        return [_one_prompt(prompt)]


def _one_prompt(prompt: Any) -> str | list[int]:
    """A prompt as text or token ids; ValueError for an empty or malformed one."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt
    ids = _token_ids(prompt) if isinstance(prompt, list) else None
    if not ids:
        raise ValueError(
            "the prompt must be text, token ids (integers from 0 to 2^32-1), or a list "
            "of one of those; it is empty or holds something else"
        )
    return ids


# OpenAI's rule: a message has content, but an assistant's may be left out when it made
# tool or function calls (a template renders those instead).
# What counts as having made calls: a non-empty tool_calls list, or a function_call object.
_CALLS = {
    "tool_calls": {"type": "array", "minItems": 1},
    "function_call": {"type": "object"},
}
_CONTENT_GIVEN = {
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        *(
            {
                "required": ["role", call],
                "properties": {"role": {"const": "assistant"}, call: schema},
            }
            for call, schema in _CALLS.items()
        ),
    ],
    # A tool message names the call it answers (ChatMessage._has_content).
    "if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
    "then": {
        "required": ["tool_call_id"],
        "properties": {"tool_call_id": {"type": "string", "minLength": 1}},
    },
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra=_CONTENT_GIVEN)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[dict[str, Any]], _TEXT_PARTS] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict[str, Any]] | None):
        # The models are text-only: an image or audio part dropped in silence would be
        # answered as if the user had not sent it.
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if kind != "text":
                raise ValueError(
                    f"only text content parts ({{'type': 'text', 'text': ...}}) are "
                    f"supported, got type {kind!r}"
                )
            if not isinstance(part.get("text"), str):
                # A text part without its text said "got type 'text'" (a tester).
                said = "no text" if "text" not in part else f"text {part['text']!r:.40}"
                raise ValueError(
                    f"a text content part needs its text as a string ({{'type': 'text', "
                    f"'text': ...}}), got {said}"
                )
        return content

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # Left out, a user's words rendered as nothing: the model answered a turn nobody
        # wrote (OpenAI refuses it).
        extra = self.model_extra or {}
        called = (isinstance(extra.get("tool_calls"), list) and extra["tool_calls"]) or isinstance(
            extra.get("function_call"), dict
        )
        if self.content is None and not (self.role == "assistant" and called):
            article = "an" if self.role == "assistant" else "a"
            raise ValueError(
                f"{article} {self.role} message needs content (null or left out is allowed only "
                "for an assistant message with tool_calls or function_call)"
            )
        # The call it answers: OpenAI refuses a tool message without it, and a template
        # that pairs results with calls by it renders nothing or fails without it.
        call_id = extra.get("tool_call_id")
        if self.role == "tool" and not (isinstance(call_id, str) and call_id):
            raise ValueError(
                "a tool message needs tool_call_id, the id of the assistant's tool call it "
                "answers (a non-empty string)"
            )
        return self

    def as_template_input(self) -> dict[str, Any]:
        # As sent: a template may loop over content parts, as transformers lets it; keys
        # set to null are dropped by gateway_svc.chat.template_messages.
        return {**(self.model_extra or {}), "role": self.role, "content": self.content}


# At most this many messages, and content parts over all of them, per chat request. Each
# is validated on the gateway's event loop, about 3 us apiece: a 32 MiB body of 950,000
# tiny messages held every other stream for 3 s. Each renders to several tokens, so
# this many fill a 64k-token context.
MAX_MESSAGES = 16_384


# The most JSON values (each object, array, string, number, ... counts one) a chat
# request's message fields other than role and content may hold over all messages, and
# its chat_template_kwargs' values: what a template reads (tool_calls, name, ...) takes a
# few each. Unbounded, 8 million empty objects in one message's field (a 33 MB body)
# were copied into the render process, which ran out of memory: a 500 blaming the
# model's template, and the gateway held for 2-3 s (a tester).
MAX_TEMPLATE_VALUES = 65_536


def _more_values_than(values: Any, budget: int) -> bool:
    """Whether the JSON values in ``values`` (an iterable) number more than ``budget``;
    stops counting past it, so a huge value costs no more than the budget."""
    count = 0
    stack = [iter(values)]
    while stack:
        for value in stack[-1]:
            count += 1
            if count > budget:
                return True
            if isinstance(value, dict | list):
                stack.append(iter(value.values() if isinstance(value, dict) else value))
                break
        else:
            stack.pop()
    return False


# chat_template_kwargs: how many, and the names the gateway sets itself (the request has
# its own fields for these).
MAX_TEMPLATE_VARIABLES = 64
_RENDER_OWN = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
_TEMPLATE_VARIABLE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class ChatBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, messages: Any) -> Any:
        """Refuse more than MAX_MESSAGES messages or content parts before validating
        any of them (the count first, so a huge list costs one len())."""
        if not isinstance(messages, list):
            return messages
        if len(messages) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages per request, got {len(messages)}")
        parts = sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), list)
        )
        if parts > MAX_MESSAGES:
            raise ValueError(
                f"at most {MAX_MESSAGES} content parts per request (over all messages), got {parts}"
            )
        extras = (
            value
            for m in messages
            if isinstance(m, dict)
            for key, value in m.items()
            if key not in ("role", "content")
        )
        if _more_values_than(extras, MAX_TEMPLATE_VALUES):
            raise ValueError(
                f"the messages' fields other than role and content hold more than "
                f"{MAX_TEMPLATE_VALUES} JSON values"
            )
        return messages

    tools: Any = _declined(_DECLINED_CHAT, "tools")
    tool_choice: Any = _declined(_DECLINED_CHAT, "tool_choice")
    functions: Any = _declined(_DECLINED_CHAT, "functions")
    function_call: Any = _declined(_DECLINED_CHAT, "function_call")
    modalities: Any = _declined(_DECLINED_CHAT, "modalities")
    audio: Any = _declined(_DECLINED_CHAT, "audio")
    continue_final_message: Any = _declined(_DECLINED_CHAT, "continue_final_message")
    chat_template: Any = _declined(_DECLINED_CHAT, "chat_template")
    documents: Any = _declined(_DECLINED_CHAT, "documents")
    web_search_options: Any = _declined(_DECLINED_CHAT, "web_search_options")
    verbosity: Any = _declined(_DECLINED_CHAT, "verbosity")
    # vLLM's (as transformers' apply_chat_template takes them): whether the prompt ends
    # with the template's opening of an assistant turn, and further variables the
    # template reads (Qwen3's enable_thinking, say), which win over the special tokens'
    # names as in transformers.
    add_generation_prompt: bool | None = True
    # vLLM's: special tokens (BOS) added by the tokenizer on top of those the template
    # wrote (off by default, as in vLLM: the template writes what the model wants).
    add_special_tokens: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={
            "anyOf": [
                {
                    "type": "object",
                    "maxProperties": MAX_TEMPLATE_VARIABLES,
                    "propertyNames": {
                        "pattern": _TEMPLATE_VARIABLE.pattern,
                        "not": {"enum": sorted(_RENDER_OWN)},
                    },
                },
                {"type": "null"},
            ]
        },
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, variables: dict[str, Any] | None) -> dict[str, Any]:
        variables = variables or {}
        if len(variables) > MAX_TEMPLATE_VARIABLES:
            raise ValueError(f"at most {MAX_TEMPLATE_VARIABLES} template variables")
        if _more_values_than(variables.values(), MAX_TEMPLATE_VALUES):
            raise ValueError(
                f"the template variables hold more than {MAX_TEMPLATE_VALUES} JSON values"
            )
        for name in variables:
            if not _TEMPLATE_VARIABLE.match(name) or name in _RENDER_OWN:
                raise ValueError(
                    f"{name[:64]!r} is no variable a request may set: a letter, then "
                    f"letters, digits or '_', other than {', '.join(sorted(_RENDER_OWN))}"
                )
        return variables
