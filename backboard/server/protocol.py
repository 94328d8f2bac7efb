"""OpenAI-compatible request schemas (pydantic, validated by FastAPI) and their translation into
SamplingParams. Unknown fields are accepted and ignored, as OpenAI and vLLM do; known fields are
strictly typed (pydantic strict mode: `"stream": "yes"`, `"n": true` or `"max_tokens": "5"` are
400s, not coerced; an integer is still a valid float). `user` only feeds `--fairness user`.

Supported beyond OpenAI's fields (vLLM's names): top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, include_stop_str_in_output, ignore_eos, skip_special_tokens, prompt_logprobs.
Left out, with a clear 400: `echo`, `suffix`, non-empty `logit_bias`, `best_of` other than n, and
a completions batch of more than one prompt (send one request per prompt)."""

from __future__ import annotations

import json
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from backboard.sampling_params import SamplingParams
from backboard.server.errors import APIError, bad_request


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(_Open):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured output (server/structured.py): at most one of these
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def _check_common(self) -> None:
        """(n, stop strings and sizes are the server's limits: server/limits.py)"""
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not supported with stream=true", "prompt_logprobs")

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens)
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                              ("frequency_penalty", 0.0)):
            v = getattr(self, name)
            kw[name] = default if v is None else v
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(str(e), _param_of(str(e), kw)) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _param_of(message: str, fields: dict[str, Any]) -> str | None:
    """SamplingParams messages start with the parameter's name."""
    first = message.split(" ", 1)[0]
    return first if first in fields else None


# ---- /v1/completions -------------------------------------------------------------------------
Prompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool | None = None          # vLLM's: each choice (chunk) carries its token ids

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return p                               # token ids
        if len(p) > 1:
            raise bad_request(f"a batch of {len(p)} prompts is not supported; send one request per prompt",
                              "prompt")
        return p[0]

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise bad_request(f"best_of must equal n ({self.n}); got {self.best_of}", "best_of")
        return self._params(self.max_tokens, self.logprobs)


# ---- /v1/chat/completions --------------------------------------------------------------------
class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # assistant turns that called tools
    tool_call_id: str | None = None                    # tool results
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise bad_request(f"content parts of type {p.type!r} are not supported (text only)",
                                  "messages")
            parts.append(p.text)
        return "".join(parts)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (text content only; tool calls with their
    arguments as objects, as templates iterate them)."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _template_call(call: dict[str, Any], i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls: each call needs function.name", "messages")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise bad_request(f"messages[{i}].tool_calls: arguments of {fn['name']} are not JSON: {e}",
                              "messages") from e
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)

    def check_tools(self) -> None:
        """tools and tool_choice as OpenAI defines them (400s naming the field)."""
        names = []
        for i, t in enumerate(self.tools or ()):
            fn = t.get("function") if isinstance(t, dict) else None
            if t.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
                raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                  "tools")
            names.append(fn["name"])
        tc = self.tool_choice
        if isinstance(tc, str) and tc not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice must be auto, none, required or a function; got {tc!r}", "tool_choice")
        if tc is not None and tc != "none" and not names:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if isinstance(tc, dict):
            name = (tc.get("function") or {}).get("name") if tc.get("type") == "function" else None
            if name is None:
                raise bad_request("tool_choice must be {'type': 'function', 'function': {'name': ...}}",
                                  "tool_choice")
            if name not in names:
                raise bad_request(f"tool_choice names an unknown tool {name!r}; tools: {names}", "tool_choice")

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools the template and the parser see (none with tool_choice "none")."""
        return None if self.tool_choice == "none" else (self.tools or None)

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs}",
                              "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, lp)


# ---- /tokenize, /detokenize (vLLM's shapes) ---------------------------------------------------
class TokenizeCompletionRequest(_Open):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Open):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

