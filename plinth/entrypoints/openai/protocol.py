"""The OpenAI wire format: request and response bodies as pydantic models.

Requests ignore unknown fields (clients send many optional ones); fields plinth does not
support are declared so that a non-default value is refused with a clear 400 rather than
silently ignored. Beyond the OpenAI fields, requests accept the usual sampling extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``) and vLLM's structured-output
fields (``structured_outputs``, ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``).
Chat requests take OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (see
:mod:`plinth.entrypoints.openai.tools`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_serializer, model_validator

from plinth.core.request import MIN_TOKENS_CONFLICT, SamplingParams, SamplingParamsError
from plinth.core.structured import normalize as normalize_structured
from plinth.entrypoints.openai.tools import tool_mode


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)   # a value of the wrong JSON type is refused
    #: fields whose explicit null means something of its own (completions' ``max_tokens``: up to the context)
    NULL_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit ``null`` for a field with a non-null default means that default (the OpenAI reference
        types such fields "or null", and clients send ``null`` for fields they leave unset)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        nulls = [k for k, v in data.items() if v is None and k in fields and k not in cls.NULL_IS_A_VALUE
                 and not fields[k].is_required() and fields[k].get_default(call_default_factory=True) is not None]
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: usage so far on every chunk


class _NamedExtras(_Request):
    """A request whose unknown fields are kept (``model_extra``) so that the server can name them in its log,
    as vLLM does."""

    model_config = ConfigDict(extra="allow")
    #: vLLM's: cached KV blocks are shared only among requests with the same salt (LLMEngine.add_request)
    cache_salt: str | None = None

    def ignored_fields(self) -> list[str]:
        """The request's fields plinth does not know (ignored)."""
        return sorted(self.model_extra or ())


class _SamplingFields(_NamedExtras):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # structured outputs as vLLM's server takes them (only one of these and response_format)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
    priority: int = 0   # vLLM's: with --scheduling-policy priority, lower runs first
    use_beam_search: bool = False   # vLLM's: n beams, the n best returned (plinth.entrypoints.beam_search)
    length_penalty: float = 1.0
    # vLLM's request extensions
    prompt_logprobs: int | None = None          # log-probabilities of the prompt's tokens (top k besides)
    add_special_tokens: bool | None = None      # default: true for completions, false for chat (the template's)
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last N tokens
    return_tokens_as_token_ids: bool | None = None   # logprob tokens as "token_id:N" (default: the server's flag)
    bad_words: list[str] | None = None
    spaces_between_special_tokens: bool = True
    vllm_xargs: dict[str, Any] | None = None   # the request's extra_args, for the server's custom logits processors

    def structured(self) -> tuple[str, dict[str, Any]] | None:
        """``(field, spec)``: the constraint asked for (a ``structured_outputs`` value, see
        :mod:`plinth.core.structured`) and the request field it came from; ``None`` for free text.

        Raises:
            SamplingParamsError: naming the field, for a malformed ``response_format`` or two constraints.
        """
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict | str):
                    raise SamplingParamsError("response_format", "json_schema needs {\"json_schema\": {\"schema\": "
                                              "{...}}}")
                asked.append(("response_format", {"json": schema}))
            elif kind not in (None, "text"):
                raise SamplingParamsError("response_format", f"type must be 'text', 'json_object' or 'json_schema', "
                                          f"got {kind!r}")
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs))
        asked.extend(self._tool_constraint())
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, {key: value}))
        if len(asked) > 1:
            raise SamplingParamsError(asked[1][0], f"only one structured output constraint per request "
                                      f"(also given: {asked[0][0]})")
        return asked[0] if asked else None

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        """The constraint a tool choice adds (chat requests)."""
        return []

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for the first field set to a value plinth cannot honour."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if not self.spaces_between_special_tokens:
            return "spaces_between_special_tokens", "spaces_between_special_tokens: false is not supported"
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            return "prompt_logprobs", f"must be at least 0, got {self.prompt_logprobs}"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs is not available when streaming"
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            return "seed", f"must be a 64-bit signed integer, got {self.seed}"
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):   # before any tokenizing
            return "truncate_prompt_tokens", (f"must be at least 1 (or -1: the model's context), got "
                                              f"{self.truncate_prompt_tokens}")
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters; raises ``SamplingParamsError`` naming a bad field. ``defaults``: the
        model's generation config (:mod:`plinth.model_registry.generation_config`), for fields left unset."""
        model = defaults or {}
        plain = SamplingParams()

        def pick(value: Any, name: str) -> Any:
            return model.get(name, getattr(plain, name)) if value is None else value

        structured = self.structured()
        spec = None
        if structured is not None:
            field, spec = structured
            try:   # the shape here; whether it compiles in the server's worker thread (serving.check_structured)
                spec = normalize_structured(spec)
            except ValueError as exc:
                raise SamplingParamsError(field, str(exc)) from None
            if (self.min_tokens or 0) > 0:   # named as given: response_format, guided_json, tool_choice, ...
                raise SamplingParamsError("min_tokens", MIN_TOKENS_CONFLICT.format(field))

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature"),
            top_p=pick(self.top_p, "top_p"),
            top_k=pick(self.top_k, "top_k"),
            min_p=pick(self.min_p, "min_p"),
            presence_penalty=pick(self.presence_penalty, "presence_penalty"),
            frequency_penalty=pick(self.frequency_penalty, "frequency_penalty"),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty"),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            structured_outputs=spec,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            extra_args=self.vllm_xargs,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = None
    #: vLLM's: prompts given as embeddings, each base64 text of ``torch.save``'s bytes of a ``[positions, hidden]``
    #: tensor (a server started with ``--enable-prompt-embeds``); they come before ``prompt``'s in the choices
    prompt_embeds: str | list[str] | None = None
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (only best_of equal to n)"
        if self.logprobs is not None and self.logprobs < 0:   # (-1, the whole vocabulary: offline only)
            return "logprobs", f"must be at least 0, got {self.logprobs}"
        return super().unsupported()


class ContentPart(_Request):
    type: str
    text: str | None = None
    refusal: str | None = None   # an assistant message's refusal part (its text, for the template)
    image_url: dict[str, Any] | str | None = None   # an image part: {"url": "data:image/...;base64,..."}
    video_url: dict[str, Any] | str | None = None   # a video part: {"url": "data:video/mp4;base64,..."}


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                  # a tool message: the call it answers
    # an assistant's earlier thinking, as plinth's replies give it (templates of thinking models read it back)
    reasoning_content: str | None = None
    reasoning: str | None = None                     # vLLM's newer name for it


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: StrictBool = True   # vLLM's: false leaves reasoning_content out (the model still thinks)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None   # for templates that render retrieved documents
    echo: StrictBool = False   # vLLM's: the reply starts with the last message when it has the reply's role
    functions: list[Any] | None = None        # the deprecated form of tools
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    #: OpenAI's thinking budget; the chat template reads it as ``reasoning_effort`` (gpt-oss's does)
    reasoning_effort: ReasoningEffort | None = None
    #: vLLM's: settings of the image processor for this request's images (as ``--mm-processor-kwargs`` takes them)
    mm_processor_kwargs: dict[str, Any] | None = None

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return []
        mode = tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls, None)
        spec = mode.constraint() if mode is not None else None
        return [("tool_choice", spec)] if spec is not None else []

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "the deprecated functions field is not supported: use tools"
        if self.function_call not in (None, "none"):
            return "function_call", "the deprecated function_call field is not supported: use tool_choice"
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            return ("audio" if self.audio is not None else "modalities"), "only text output is supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        if self.top_logprobs is not None and self.top_logprobs < 0:   # (-1, the whole vocabulary: offline only)
            return "top_logprobs", f"must be at least 0, got {self.top_logprobs}"
        return super().unsupported()


class _PoolingInput(_NamedExtras):
    """The input of a pooling route: ``input`` (texts or token ids), or a conversation as vLLM's chat-form
    pooling requests give it: ``messages`` rendered with the chat template (without the assistant's opening unless
    ``add_generation_prompt``; the template writes the special tokens, so ``add_special_tokens`` defaults to false
    there)."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # default: true for an input, false for messages
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (as asked, else for ``input`` but not ``messages``)."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class EmbeddingRequest(_PoolingInput):
    """``POST /v1/embeddings`` (an engine with ``task="embed"``)."""

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str   # base64: the little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class _ListResponse(BaseModel):
    """A list of results (embeddings, scores) with the prompt tokens used."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: EmbeddingUsage


class EmbeddingResponse(_ListResponse):
    data: list[EmbeddingData]


class ClassificationRequest(_PoolingInput):
    """``POST /classify`` (vLLM's; an engine with ``task="classify"``): each input's label probabilities."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    activation: bool | None = None   # use_activation's older name
    priority: int = 0


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationUsage(EmbeddingUsage):
    completion_tokens: int = 0   # as vLLM's classification usage


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]
    usage: ClassificationUsage


class PoolingRequest(_PoolingInput):
    """``POST /pooling`` (vLLM's; an embedding or classification engine): each input's pooled output as numbers,
    for any of the model's pooling tasks (``token_embed``, ``token_classify``: one row per input token)."""

    model: str | None = None
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    activation: bool | None = None   # use_activation's older name
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | list[list[float]] | str   # base64: the little-endian float32 bytes, rows one after another


class PoolingResponse(_ListResponse):
    data: list[PoolingData]
    usage: ClassificationUsage


class ScoreRequest(_NamedExtras):
    """``POST /v1/score`` (vLLM's): the similarity of ``text_1`` with each ``text_2`` (one against many), or of the
    pairs of two lists of the same length; texts or token-id lists."""

    model: str | None = None
    text_1: str | list[int] | list[str] | list[list[int]]
    text_2: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankRequest(_NamedExtras):
    """``POST /v1/rerank`` (Jina's and Cohere's shape, as vLLM serves it): ``documents`` ordered by their relevance to
    ``query``, the ``top_n`` first (all without it, or for 0 or less, as vLLM)."""

    model: str | None = None
    query: str | list[int]
    documents: list[str] | list[list[int]]
    top_n: StrictInt | None = None
    return_documents: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankDocument(BaseModel):
    text: str | None = None
    token_ids: list[int] | None = None


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None   # shown to templates that render tools, as in a chat request
    documents: list[dict[str, Any]] | None = None   # as in a chat request
    mm_processor_kwargs: dict[str, Any] | None = None   # as in a chat request
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# ----------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _without_empty_extras(handler, self)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


def _without_empty_extras(handler: Any, value: BaseModel) -> dict[str, Any]:
    out = handler(value)
    # only when there are some (OpenAI's shape otherwise)
    for key in ("tool_calls", "reasoning_content", "prompt_logprobs"):
        if out.get(key) is None:
            out.pop(key, None)
    return out


#: vLLM's prompt log-probabilities: ``None`` for the first token, then per token ``{token id: {"logprob",
#: "rank", "decoded_token"}}`` for the prompt's token and the k most likely
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class ResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # {"id", "type": "function", "function": {"name", "arguments"}}
    reasoning_content: str | None = None              # the thinking, with --reasoning-parser

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _without_empty_extras(handler, self)


class DeltaMessage(BaseModel):
    """A streamed chunk's change to a message; fields without a value are left out (OpenAI's chunks: the role in
    the first, with its content even when that is null, then only the new content, and ``{}`` with the finish
    reason)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # streamed pieces, by "index"
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        out = _without_empty_extras(handler, self)
        if out.get("role") is None:
            out.pop("role", None)
            if out.get("content") is None:
                out.pop("content", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _without_empty_extras(handler, self)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "plinth"
    root: str | None = None      # a LoRA adapter's folder
    parent: str | None = None    # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (with ``--allow-runtime-lora-updating``); ``load_inplace`` (vLLM's): replace
    the adapter served under that name."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UpdateWeightsRequest(_Request):
    """``POST /update_weights`` (with ``--enable-weight-updates``): new values for the served model's weights from a
    safetensors checkpoint on the server's disk (a file or a directory of them, all weights or some)."""

    path: str
    reset_prefix_cache: bool = True


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (with ``--allow-runtime-lora-updating``)."""

    lora_name: str
    lora_int_id: int | None = None


class ResponsesRequest(_NamedExtras):
    """``POST /v1/responses`` (OpenAI's Responses API, stateless: text in, text out).

    ``input`` is a string (one user message) or a list of messages (``{"role", "content"}``, optionally with
    ``"type": "message"``; content a string or ``input_text``/``output_text`` parts); ``instructions`` becomes a
    system message. ``text.format`` may ask for JSON (``json_object``) or a JSON schema (``json_schema``).
    """

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    priority: int = 0
    # vLLM's sampling extensions, as on the chat route
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    vllm_xargs: dict[str, Any] | None = None   # the request's extra_args, for the server's custom logits processors

    #: the fields passed on to the chat request as they are
    CHAT_FIELDS: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "user", "priority", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "vllm_xargs")
