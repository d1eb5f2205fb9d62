"""The OpenAI wire format: request bodies (pydantic), the error shape, and the response /
stream-chunk bodies built from the client's StreamChunk / GenerationResult.

Request fields map onto SamplingParams by the same names (vLLM's), so `SamplingParams`
stays the one place that validates them: its InvalidArgument names the field, which
becomes the error's `param`. Chat requests also take vLLM's chat-template extras
(add_generation_prompt, continue_final_message, chat_template_kwargs), and a completion
several prompts, each sampled `n` times (one generation per choice, as vLLM). What OpenAI
defines and this server does not do (best_of > n, suffix, tool calls,
structured output, beam search, ...) is refused with 400 naming the field, never silently
ignored. A field no API defines is ignored and logged, as vLLM does.
"""

from __future__ import annotations

import codecs
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from client.output import json_logprob
from client.speculative import GenerationResult, StreamChunk
from specdec.errors import InvalidArgument, display_value
from specdec.sampling import SamplingParams

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_CHOICES = 64  # generations one request may start (prompts x n): each holds a slot and a session


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        # Echoed request text may hold a lone surrogate (JSON's "\ud800"), which no UTF-8 body can
        # carry: rendering the error failed with a 500 and a reset connection.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- requests -------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk carries its choice's usage so far


# Fields of OpenAI's API or vLLM's server that change what is generated or returned, and that
# this server does not do: refused when set to anything but their default (name -> the value
# that means "off"). Output that only looks constrained is worse than a 400.
_NOT_DONE: dict[str, object] = {
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "structured_outputs": None,
    "functions": None, "function_call": None, "use_beam_search": False, "length_penalty": None,
    "bad_words": None,
    "logits_processors": None, "truncate_prompt_tokens": None, "audio": None, "prediction": None,
    "chat_template": None, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "max_completion_tokens": None,  # /v1/completions only: chat defines it (max_tokens is completions')
    "return_tokens_as_token_ids": False, "return_token_ids": False, "prompt_embeds": None, "vllm_xargs": None,
    "response_format": None,  # /v1/completions only (vLLM's CompletionRequest has it): chat checks its own
}
# Of those, the ones whose empty list or object also means "off"; an empty guided_json schema
# ({}) is vLLM's "any JSON value", a constraint.
_EMPTY_IS_OFF = {"functions", "bad_words", "logits_processors", "structured_outputs", "vllm_xargs"}


class _Sampling(BaseModel):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="allow")  # kept to be checked by refuse_unsupported

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs under the raw model (top N, 0 = their own)
    request_id: str | None = None  # vLLM's: names the response (cmpl-<id>) unless an X-Request-Id header does
    best_of: int | None = None
    # this server's: SamplingParams' acceptance rule per request (vLLM sets it per server, with
    # --spec-decoding-acceptance-method); "typical" is not lossless
    acceptance_method: str | None = None
    posterior_threshold: float | None = None
    posterior_alpha: float | None = None

    def refuse_unsupported(self) -> None:
        extra = dict(self.model_extra or {})
        for name, off in _NOT_DONE.items():
            if name in extra:
                value = extra.pop(name)
                if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
                    continue  # plain text, what every reply is
                if value is not None and value != off and not (name in _EMPTY_IS_OFF and value in ([], {})):
                    raise bad_request(name, f"{name} is not supported by this server")
        modalities = extra.pop("modalities", None)
        if modalities not in (None, ["text"]):
            raise bad_request("modalities", f"only text output is supported, got modalities={modalities!r}")
        if extra:  # `user`, `metadata`, `store`, ...: no effect on generation
            log.info("request fields ignored: %s", ", ".join(sorted(extra)))
        if self.n is not None and self.n < 1:
            raise bad_request("n", f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < (self.n or 1):  # vLLM's rule
            raise bad_request("best_of", f"best_of must be >= n ({self.n or 1}), got {self.best_of}")
        if self.best_of not in (None, self.n or 1):  # best_of > n would rank choices by logprob: not done
            raise bad_request("best_of", f"best_of > n is not supported: set it to n ({self.n or 1}) or leave it out, "
                                         f"got {self.best_of}")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options needs stream=true")
        if self.stream and self.prompt_logprobs is not None:  # vLLM's rule (an echoed prompt's logprobs do stream)
            raise bad_request("prompt_logprobs", "prompt_logprobs are not available when stream=true")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (if it has one) before a text prompt
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """vLLM's scoring request: echo with max_tokens 0 answers the prompt alone (with its
        logprobs), and generates one token to get them."""
        return self.echo and self.max_tokens == 0

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise bad_request("suffix", "suffix is not supported")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list, or a list of either (a batch)."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for i, p in enumerate(batch):
            if not p:
                raise bad_request("prompt", "the prompt is empty" if len(batch) == 1 else f"prompt[{i}] is empty")
        return batch


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id: passed to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


# apply_chat_template's own parameters: what the request's fields set, or what a request must
# not choose (the template itself, tokenization): never taken from chat_template_kwargs.
_TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
    "tokenizer", "add_special_tokens",  # SpeculativeClient.encode_chat's own
})


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's chat-template extras: an assistant prefix to continue, and the template's own
    # variables (e.g. Qwen3's enable_thinking)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: for RAG templates, rendered as the template's `documents`
    add_special_tokens: bool = False  # vLLM's: special tokens on top of the template's (which has its BOS)
    echo: bool = False  # vLLM's: the last message's content before the reply (refused)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise bad_request("echo", "echo is not supported")
        # As vLLM: tools default tool_choice to "auto", which needs a tool-call parser; with
        # "none" the tools are only rendered into the prompt (the chat template's `tools`).
        if self.tool_choice not in (None, "none") or (self.tools and self.tool_choice is None):
            raise bad_request("tool_choice", f"tool_choice {self.tool_choice or 'auto'!r} is not supported: this server "
                                             "parses no tool calls; \"none\" renders the tools into the prompt")
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request("response_format", f"response_format {self.response_format.type!r} is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs=true")
        if self.continue_final_message:
            if self.add_generation_prompt:  # vLLM's rule and wording
                raise bad_request("continue_final_message", "Cannot set both `continue_final_message` and "
                                                            "`add_generation_prompt` to True.")
            if self.messages[-1].role != "assistant":
                raise bad_request("continue_final_message", "continue_final_message needs the last message to be "
                                                            f"the assistant's, got role {self.messages[-1].role!r}")
        reserved = set(self.chat_template_kwargs or ()) & _TEMPLATE_CALL_ARGS
        if reserved:
            raise bad_request("chat_template_kwargs", f"chat_template_kwargs may only hold the template's own "
                                                      f"variables, not {', '.join(sorted(reserved))}")

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments for SpeculativeClient.encode_chat beside the messages."""
        options = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                   "continue_final_message": self.continue_final_message, "add_special_tokens": self.add_special_tokens}
        if self.tools:
            options["tools"] = self.tools
        if self.documents:
            options["documents"] = self.documents
        return options

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it: text content only."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" for p in content):
                    raise bad_request(f"messages[{i}].content", "only text content parts are supported")
                content = "\n".join(p.text or "" for p in content)  # vLLM's join of a message's text parts
            msg = {**(m.model_extra or {}), "role": "system" if m.role == "developer" else m.role,
                   "content": content or ""}
            out.append(msg)
        return out


# ---- requests -> SamplingParams ---------------------------------------------------------------


def sampling_params(req: CompletionRequest | ChatCompletionRequest, prompt_tokens: int,
                    max_context: int, vocab_size: int | None = None) -> SamplingParams:
    """The request's SamplingParams; 400 naming the field for a bad value, or when the prompt
    plus max_tokens does not fit the verifier's context (as vLLM words it)."""
    chat = isinstance(req, ChatCompletionRequest)
    prompt_field = "messages" if chat else "prompt"
    max_field, max_tokens = "max_tokens", req.max_tokens
    echo_only = not chat and req.echo_only
    if echo_only:  # a prompt that fills the context is scored whole (lm-eval's full windows), as vLLM
        max_tokens = 1  # the token its logits need, never cached, dropped from the answer
    if chat and req.max_completion_tokens is not None:
        max_field, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if prompt_tokens > max_context or (prompt_tokens == max_context and not echo_only):
        raise bad_request(prompt_field, f"This model's maximum context length is {max_context} tokens. However, your "
                                        f"{prompt_field} {'have' if prompt_field == 'messages' else 'has'} "
                                        f"{prompt_tokens} tokens, which leaves no room for a "
                                        "completion.", code="context_length_exceeded")
    if max_tokens is None:
        # An unset max_tokens never makes a prompt that fits fail: the default shrinks to the room
        # left. Completions default to 16 when the field is absent; an explicit null (and chat's
        # default) is vLLM's None: up to the context.
        room = max_context - prompt_tokens
        max_tokens = room if chat or "max_tokens" in req.model_fields_set else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif prompt_tokens + max_tokens > max_context + echo_only:
        raise bad_request(max_field, f"This model's maximum context length is {max_context} tokens. However, you "
                                     f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                                     f"{prompt_field}, {max_tokens} in the completion). Please reduce the length of "
                                     f"the {prompt_field} or {max_field}.", code="context_length_exceeded")
    if chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        logprobs, logprobs_field = req.logprobs, "logprobs"
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and not chat and req.echo and logprobs is not None:
        prompt_logprobs = logprobs  # as vLLM: an echoed prompt comes with its logprobs
    values = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "stop": req.stop,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "top_k": 0 if req.top_k == -1 else req.top_k,  # vLLM: -1 (or 0) disables top-k; below -1 is an error
        "min_p": req.min_p,
        "min_tokens": req.min_tokens,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids,
        "logit_bias": _logit_bias(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "acceptance_method": req.acceptance_method,
        "posterior_threshold": req.posterior_threshold,
        "posterior_alpha": req.posterior_alpha,
    }
    fields = {"max_tokens": max_field, "logprobs": logprobs_field}
    try:
        params = SamplingParams(**{k: v for k, v in values.items() if v is not None})
    except InvalidArgument as exc:
        name = fields.get(exc.field, exc.field)
        raise bad_request(name, f"{name}: {exc.detail}") from None
    if vocab_size is not None:
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            if bad := [t for t in ids if t >= vocab_size]:
                raise bad_request(name, f"{name}: token id {display_value(bad[0])} is outside the model's vocabulary "
                                        f"[0, {vocab_size})")
    return params


LOGIT_BIAS_BOUND = 100.0  # OpenAI's range for a bias; vLLM clamps to it


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} -> {id: bias clamped to [-100, 100]}, as vLLM."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"logit_bias: keys are token ids, got {display_value(key)}") from None
        if not math.isfinite(value):
            raise bad_request("logit_bias", f"logit_bias: the bias of token {display_value(token)} must be a finite "
                                            f"number, got {value}")
        out[token] = max(-LOGIT_BIAS_BOUND, min(LOGIT_BIAS_BOUND, value))
    return out


# ---- responses ------------------------------------------------------------------------------


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One prompt's n choices: a seeded request's choice j draws with seed + j, so the choices
    differ from each other and each reproduces (choice 0 is the same request with n=1)."""
    if params.seed is None:
        return [params] * n
    return [params.replace(seed=(params.seed + j) % 2**64) for j in range(n)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative(*results: GenerationResult) -> dict:
    """The speculative counters of one generation, or summed over a request's choices (an
    extra field; `usage` stays OpenAI's)."""
    drafts, accepted = sum(r.num_draft_tokens for r in results), sum(r.num_accepted_tokens for r in results)
    return {"num_rounds": sum(r.num_rounds for r in results),
            "num_speculative_rounds": sum(r.num_speculative_rounds for r in results), "num_draft_tokens": drafts,
            "num_accepted_tokens": accepted, "acceptance_rate": accepted / drafts if drafts else 0.0,
            "draft_time_s": sum(r.draft_time_s for r in results),
            "verify_time_s": sum(r.verify_time_s for r in results),
            "proposal_bytes": sum(r.proposal_bytes for r in results)}  # q on the wire (--proposal's form)


@dataclass
class ResponseBuilder:
    """Builds one request's bodies: the non-streamed response, or its SSE chunks in order.

    A request has `num_choices` choices (n per prompt, prompts in order: choice i is prompt
    i // n's, as vLLM numbers them). Stream order (as OpenAI): [chat: a role chunk per
    choice] · per choice, a chunk per round that produced text, then one with finish_reason
    (and that choice's speculative counters), choices interleaved as their rounds arrive ·
    [include_usage: after every choice finished, a chunk with empty choices and usage; every
    chunk before it carries "usage": null, or with continuous_usage (vLLM's
    continuous_usage_stats) its choice's usage so far: its prompt and its tokens up to that chunk].

    echo (completions): each choice's text starts with its prompt, and its logprobs with the
    prompt's (the first token has none), in the body or in the choice's first chunk, as vLLM;
    echo_only (max_tokens 0) answers the prompt alone. prompt_logprobs: the request asked for
    them (SamplingParams.prompt_logprobs): each choice (chat: the response) carries vLLM's
    `prompt_logprobs` list."""

    chat: bool
    model: str
    prompt_tokens: int  # of all the request's prompts, each counted once (not per choice)
    decode: Any  # token id -> its text
    token_bytes: Any = None  # token id -> its own bytes (client.output.TokenBytes); None: its text's UTF-8
    include_usage: bool = False
    continuous_usage: bool = False
    choice_prompts: list[list[int]] = field(default_factory=list)  # per choice: its prompt's ids
    logprobs: bool = False
    num_choices: int = 1
    echo: bool = False
    echo_only: bool = False
    echo_texts: list[str] = field(default_factory=list)  # per choice: its prompt's text (echo)
    prompt_logprobs: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)  # per choice: text_offset of its next logprob
    _utf8: dict[int, Any] = field(default_factory=dict)  # per choice: the bytes of a character still incomplete
    _echoed: set[int] = field(default_factory=set)  # choices whose stream has sent its prompt
    _generated: dict[int, int] = field(default_factory=dict)  # per choice: tokens streamed so far

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.token_bytes = self.token_bytes or (lambda token_id: self.decode(token_id).encode("utf-8"))

    def response(self, results: list[GenerationResult]) -> dict:
        """The non-streamed body: one choice per result, in choice order."""
        choices = []
        for index, result in enumerate(results):
            text, entries = self._echoed_output(index, result.text, result.logprobs, result.prompt_logprobs)
            lp = self._logprobs(entries, index) if self.logprobs else None
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": lp, "finish_reason": result.finish_reason,
                                "stop_reason": result.stop_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": lp, **self._finish_reason(result)})
                if self.prompt_logprobs:
                    choices[-1]["prompt_logprobs"] = self._vllm_prompt_logprobs(result)
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices,
                "usage": self._usage(results), "speculative": speculative(*results)}
        if self.chat and self.prompt_logprobs and results:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(results[0])
        return body

    def start(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._chunk({"role": "assistant", "content": ""}, None, index=i) for i in range(self.num_choices)]

    def chunks(self, chunk: StreamChunk, index: int = 0) -> list[dict]:
        """The SSE bodies for one round's chunk of choice `index` (none for a round whose text
        is held back).

        The text is the client's as it settled it (client/output.py): a tail that could begin a
        stop string, or an incomplete UTF-8 sequence, is held back there until a later round
        settles it, so the chunks concatenate to the non-streamed text."""
        out = []
        result = chunk.result
        if not self.echo_only:
            self._generated[index] = self._generated.get(index, 0) + len(chunk.token_ids)
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            text, entries = self._echoed_output(index, chunk.text, chunk.logprobs, chunk.prompt_logprobs)
        else:
            text, entries = ("", None) if self.echo_only else (chunk.text, chunk.logprobs)
        lp = self._logprobs(entries, index) if self.logprobs and entries else None
        if text or lp:
            out.append(self._chunk({"content": text} if self.chat else text, None, lp, index))
        if result is not None:
            ended = self._finish_reason(result)
            last = self._chunk({} if self.chat else "", ended["finish_reason"], index=index)
            last["choices"][0]["stop_reason"] = ended["stop_reason"]
            last["speculative"] = speculative(result)
            out.append(last)
        return out

    def end(self, results: list[GenerationResult]) -> list[dict]:
        """The bodies after every choice finished: the usage chunk, if asked for."""
        return [self._envelope([], self._usage(results))] if self.include_usage else []

    def _usage(self, results: list[GenerationResult]) -> dict:
        return usage(self.prompt_tokens, 0 if self.echo_only else sum(len(r.token_ids) for r in results))

    def _finish_reason(self, result: GenerationResult) -> dict:
        if self.echo_only:  # the token generated to score the prompt is not part of the answer
            return {"finish_reason": "length", "stop_reason": None}
        return {"finish_reason": result.finish_reason, "stop_reason": result.stop_reason}

    def _echoed_output(self, index: int, text: str, entries: list[dict] | None,
                       prompt_logprobs: list[dict | None] | None) -> tuple[str, list[dict] | None]:
        """Choice `index`'s text and logprob entries with its prompt in front when echoing."""
        if self.echo_only:
            text, entries = "", [] if entries is not None else None
        if not self.echo:
            return text, entries
        prompt_text, prompt_ids = self.echo_texts[index], self.choice_prompts[index]
        if entries is not None:
            scored = prompt_logprobs or [None] * len(prompt_ids)
            entries = [{"token_id": t, "logprob": None, "top_logprobs": {}} if e is None else e
                       for t, e in zip(prompt_ids, scored)] + entries
        return prompt_text + text, entries

    def _vllm_prompt_logprobs(self, result: GenerationResult) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}} of the token itself and the top N."""
        out: list[dict | None] = []
        for token, e in zip(result.prompt_token_ids, result.prompt_logprobs or []):
            if e is None:
                out.append(None)
                continue
            ranked = {token: (e["logprob"], e["rank"])}
            for rank, (t, lp) in enumerate(e["top_logprobs"].items(), 1):
                ranked.setdefault(t, (lp, rank))
            out.append({str(t): {"logprob": json_logprob(lp), "rank": rank, "decoded_token": self.decode(t)}
                        for t, (lp, rank) in ranked.items()})
        return out

    def _chunk(self, delta: dict | str, finish_reason: str | None, logprobs: dict | None = None,
               index: int = 0) -> dict:
        choice = {"index": index, "delta" if self.chat else "text": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        so_far = None
        if self.continuous_usage:
            so_far = usage(len(self.choice_prompts[index]), self._generated.get(index, 0))
        return self._envelope([choice], so_far)

    def _envelope(self, choices: list, usage_: dict | None) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            body["usage"] = usage_
        return body

    def _logprobs(self, entries: list[dict] | None, index: int) -> dict | None:
        """The client's per-token entries ({token_id, logprob, rank, top_logprobs: {id: lp}})
        in the endpoint's shape: chat's `content` list, or completions' parallel lists."""
        if entries is None:
            return None
        if self.chat:
            def item(tok: int, lp: float) -> dict:
                return {"token": self.decode(tok), "logprob": json_logprob(lp), "bytes": list(self.token_bytes(tok))}

            return {"content": [{**item(e["token_id"], e["logprob"]),
                                 "top_logprobs": [item(t, v) for t, v in e["top_logprobs"].items()]}
                                for e in entries], "refusal": None}
        tokens = [self.decode(e["token_id"]) for e in entries]
        # A token's offset is the characters of the text before it, from the tokens' bytes: the
        # part of a character that a token holds counts once, with the token that completes it
        # (decoded alone, each part is a U+FFFD of its own, and the offsets ran past the text).
        utf8 = self._utf8.setdefault(index, codecs.getincrementaldecoder("utf-8")("replace"))
        offsets, offset = [], self._offsets.get(index, 0)
        for e in entries:
            offsets.append(offset)
            offset += len(utf8.decode(self.token_bytes(e["token_id"])))
        self._offsets[index] = offset
        # An echoed prompt's first token has no logprob: null in both lists, as vLLM.
        return {"tokens": tokens,
                "token_logprobs": [None if e["logprob"] is None else json_logprob(e["logprob"]) for e in entries],
                # As vLLM: the sampled token leads each top_logprobs dict (logprobs=0 gives just it).
                "top_logprobs": [None if e["logprob"] is None else
                                 {self.decode(e["token_id"]): json_logprob(e["logprob"]),
                                  **{self.decode(t): json_logprob(v) for t, v in e["top_logprobs"].items()}}
                                 for e in entries],
                "text_offset": offsets}


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion's `prompt` or a chat's `messages` (with the chat
    template's options), tokenized exactly as that request would be."""

    model_config = ConfigDict(extra="allow")  # a field vLLM's /tokenize lacks: ignored and logged, as there
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: the endpoint's (True for a prompt, False for messages)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as vLLM's
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def model_post_init(self, __context: Any) -> None:
        _log_ignored(self)

    def as_request(self) -> CompletionRequest | ChatCompletionRequest:
        """The completion or chat request whose prompt this is: its checks and its encoding."""
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt", "give either prompt or messages")
        special = {} if self.add_special_tokens is None else {"add_special_tokens": self.add_special_tokens}
        if self.prompt is not None:
            return CompletionRequest(model=self.model, prompt=self.prompt, **special)
        chat = ChatCompletionRequest(model=self.model, messages=self.messages, **special,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template_kwargs=self.chat_template_kwargs,
                                     tools=self.tools, tool_choice="none" if self.tools else None,
                                     documents=self.documents)
        chat.refuse_unsupported()
        return chat


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]

    def model_post_init(self, __context: Any) -> None:
        _log_ignored(self)


def _log_ignored(request: BaseModel) -> None:
    if request.model_extra:
        log.info("request fields ignored: %s", ", ".join(sorted(request.model_extra)))


def models_list(names: list[str], root: str, max_context: int, created: int) -> dict:
    """vLLM's ModelCard for each served name: `parent` is None (no LoRA adapters here) and one
    `permission` entry with vLLM's defaults, so clients that read either find them."""
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "specdec",
                                        "root": root, "parent": None, "max_model_len": max_context,
                                        "permission": [_model_permission(n, created)]} for n in names]}


def _model_permission(name: str, created: int) -> dict:
    return {"id": f"modelperm-{name}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
