"""Pydantic request models of the OpenAI-compatible API (the OpenAPI schema comes from here).

Only requests are modelled; responses are built as plain dicts by the handlers. Models
ignore unknown fields, as OpenAI clients send new ones all the time. Bounds that OpenAI
documents are declared here, so violations become 400s naming the field. SGLang's
extensions (top_k, min_p, regex, json_schema, ebnf, ...) are accepted too: every
SamplingParams field, derived from its declaration.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from sgl.runtime.sampling_params import FIELD_NAMES, MAX_N


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class _OpenAISampling(BaseModel):
    """OpenAI's own sampling fields, with the bounds OpenAI documents (shared by completions and chat)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="this server's model; see sgl/server/model_name.py for the names accepted")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int | None = Field(None, ge=0)  # vLLM's name, not OpenAI's, but the renamed kind
    rid: str | None = None
    # PD disaggregation (sgl/server/pd.py): what a PD router adds; ignored when colocated.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None


# OpenAI's spelling of a SamplingParams field where it differs; max_tokens is read by each
# endpoint (its default and max_completion_tokens differ), so only the mapping lives here.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

# Every other SamplingParams field is an SGLang extension under its own name. Values are
# checked by SamplingParams (as on /generate), not by pydantic, so both APIs agree.
SamplingFields = create_model(
    "SamplingFields", __base__=_OpenAISampling,
    **{name: (Any, Field(None, description=f"SGLang sampling parameter {name} (see SamplingParams)"))
       for name in FIELD_NAMES
       if name not in OPENAI_NAMES and name not in _OpenAISampling.model_fields},  # type: ignore[call-overload]
)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    response_format: ResponseFormat | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
