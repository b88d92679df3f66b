"""OpenAI's request bodies as far as this server honours them, and their `sampling_parameters`.

A field OpenAI defines that changes nothing here is accepted; one this server cannot honour (audio,
the deprecated functions ...) and any unknown field are refused by name, as OpenAI refuses unknown
arguments. Tools come as OpenAI defines them: function definitions, tool_choice, the assistant's
tool_calls and the tool role's results, which the model's chat template renders. Beside OpenAI's
fields, a body (the SDK's `extra_body`) may carry vLLM's extra sampling keys and the lookahead
overrides; the server checks their values.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lookahead.config import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_WORDS, MAX_TOKEN_ID_LIST
from lookahead.contract import LOOKAHEAD_OVERRIDES, MAX_SAMPLES, STREAM_EACH_TOKEN

# OpenAI fields sent on as sampling_parameters under the same name.
_OPENAI_SAMPLING = (
    "n",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)
# vLLM's sampling keys beyond OpenAI's, which vLLM's OpenAI server also takes in the body.
VLLM_EXTRAS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
MAX_TOP_LOGPROBS = 20  # the server's bound (vLLM's)
# The model's bounds on lists (lookahead/config.py), checked here before their entries are.
_BOUNDS = {
    "stop": (MAX_STOP_STRINGS, "stop strings"),
    "logit_bias": (MAX_TOKEN_ID_LIST, "logit_bias entries"),
    "stop_token_ids": (MAX_TOKEN_ID_LIST, "stop_token_ids"),
    "stop_words": (MAX_STOP_WORDS, "stop_words"),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("schema"), dict):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return self


class _Request(_Body):
    """The fields chat and text completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # the lookahead overrides
    use_lookahead: bool | None = None
    decoding_length: int | None = None
    branch_length: int | None = None
    decoding_mode: str | None = None
    stop_words: list[str | int] | None = None
    debug: bool | None = None
    learn: bool | None = None
    drafter: str | None = None
    # streaming: a chunk per token, not per step
    stream_each_token: bool | None = None

    @field_validator("stop", "logit_bias", "stop_token_ids", "stop_words", mode="before")
    @classmethod
    def _bounded(cls, value: Any, info: Any) -> Any:
        """The model's bounds, checked before each entry is (a 2,000,000-key logit_bias would keep
        the validation busy for seconds)."""
        most, what = _BOUNDS[info.field_name]
        if isinstance(value, (list, dict)) and len(value) > most:
            raise ValueError(f"at most {most} {what}, got {len(value)}")
        if info.field_name == "stop":
            for text in [value] if isinstance(value, str) else value if isinstance(value, list) else ():
                if isinstance(text, str) and len(text) > MAX_STOP_STRING_CHARS:
                    raise ValueError(f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters long")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_parameters(self) -> dict[str, Any]:
        """The `sampling_parameters` JSON object: what the body sets, nothing it leaves out, so the
        model's own defaults apply (greedy without `temperature`)."""
        names = _OPENAI_SAMPLING + VLLM_EXTRAS + LOOKAHEAD_OVERRIDES + (STREAM_EACH_TOKEN,)
        sampling = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None:
            sampling["max_tokens"] = max_tokens
        if self.response_format is not None and self.response_format.type != "text":
            sampling["structured_outputs"] = structured_outputs(self.response_format)
        return sampling

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def structured_outputs(response_format: ResponseFormat) -> dict[str, Any]:
    """vLLM's `structured_outputs` for a `response_format` (json_object, or json_schema's schema)."""
    if response_format.type == "json_object":
        return {"json_object": True}
    return {"json": response_format.json_schema["schema"]}


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDefinition(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # the arguments match the schema: always so where tool_choice constrains


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition

    def template_tool(self) -> dict[str, Any]:
        """The definition as chat templates read it (OpenAI's shape, the schema always present)."""
        function = self.function.model_dump(exclude_none=True, exclude={"strict"})
        function.setdefault("parameters", {"type": "object", "properties": {}})
        return {"type": "function", "function": function}


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"]
    function: CalledFunction

    def template_call(self) -> dict[str, Any]:
        """The call as chat templates read it: the arguments as an object where they are JSON (the
        templates write them out with tojson), else as the text sent."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # the assistant's
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # what an assistant message copied from a response carries, accepted where it says nothing
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text parts are supported, got a part of type {part.get('type')!r}")
        return content

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages make tool calls, not {self.role}")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: a tool message needs one, and only a tool message has one")
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: the text parts joined, `developer` as `system`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted at the value that changes nothing
    store: Literal[False] | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_fits_tools(cls, choice: Any, info: Any) -> Any:
        tools = info.data.get("tools") or []
        if choice not in (None, "none") and not tools:
            raise ValueError("a tool_choice other than none needs tools")
        names = [tool.function.name for tool in tools]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"the function {choice.function.name!r} is not among the tools")
        response_format = info.data.get("response_format")
        constrains = choice == "required" or isinstance(choice, NamedToolChoice)
        if constrains and response_format is not None and response_format.type != "text":
            raise ValueError("response_format and tool_choice both constrain the output: send one")
        return choice

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or ()]

    @property
    def calls_tools(self) -> bool:
        """The output may hold tool calls: tools are given, and tool_choice is not none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constraining_tools(self) -> bool:
        """tool_choice required or named: the output is constrained to calls."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.template_tool() for tool in self.tools] if self.tools else None

    def tool_constraint(self) -> dict[str, Any] | None:
        """vLLM's structured_outputs for tool_choice required or named (as vLLM constrains them):
        a named function's output is its arguments, matching its parameters' schema; required's
        is a JSON list of {"name", "parameters"} calls (one, where parallel_tool_calls is false)."""
        if not self.constraining_tools:
            return None
        schemas = {
            tool.function.name: tool.template_tool()["function"]["parameters"] for tool in self.tools or ()
        }
        if isinstance(self.tool_choice, NamedToolChoice):
            return {"json": schemas[self.tool_choice.function.name]}
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
        listed: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.parallel_tool_calls is False:
            listed["maxItems"] = 1
        return {"json": listed}

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: Any) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_parameters(self) -> dict[str, Any]:
        sampling = super().sampling_parameters()
        if self.logprobs:
            sampling["logprobs"] = self.top_logprobs or 0
        constraint = self.tool_constraint()
        if constraint is not None:
            sampling["structured_outputs"] = constraint
        return sampling

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)


class CompletionRequest(_Request):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    # accepted at the value that changes nothing
    suffix: None = None

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def sampling_parameters(self) -> dict[str, Any]:
        sampling = super().sampling_parameters()
        if self.best_of is not None:
            sampling["best_of"] = self.best_of
        if self.logprobs is not None:
            sampling["logprobs"] = self.logprobs
            if self.echo:  # the echoed prompt's tokens come with theirs (vLLM's prompt_logprobs)
                sampling["prompt_logprobs"] = self.logprobs
        return sampling

    @property
    def scores_prompt(self) -> bool:
        """The response lists the prompt's tokens and their logprobs before the completion's."""
        return self.echo and self.logprobs is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None
