"""``POST /v1/completions``: prompts as text, token ids, or lists of either; streaming or not."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence

import torch
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.prompt_embeds import PromptEmbeds, decode_base64
from plinth.core.request import (
    CompletionOutput,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
)
from plinth.entrypoints.openai.errors import bad_request
from plinth.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from plinth.entrypoints.openai.serving import (
    ServerContext,
    beam_search_params,
    check_choices,
    check_structured,
    collect,
    finish,
    json_logprob,
    merge,
    sampling_params,
    start,
)
from plinth.entrypoints.openai.streaming import SSEResponse, unless_disconnected
from plinth.lora.request import LoRARequest


@dataclasses.dataclass
class _Prompt:
    text: str
    token_ids: list[int]
    #: positions of tokens the tokenizer added that ``text`` does not hold (a BOS before the caller's string);
    #: None where not worked out (the echo then takes special tokens whose text ``text`` lacks)
    added: frozenset[int] | None = None
    #: a prompt given as embeddings (``token_ids`` is then empty)
    embeds: PromptEmbeds | None = None

    @property
    def length(self) -> int:
        """The prompt's positions."""
        return len(self.token_ids) if self.embeds is None else len(self.embeds.embeds)

    @property
    def engine_prompt(self) -> list[int] | PromptEmbeds:
        return self.token_ids if self.embeds is None else self.embeds


async def _embeds_prompts(ctx: ServerContext, req: CompletionRequest) -> list[_Prompt]:
    """``prompt_embeds``' prompts: each read off the event loop, cut to ``truncate_prompt_tokens``."""
    raw = req.prompt_embeds
    raw = [raw] if isinstance(raw, str) else list(raw or ())
    if not raw:
        raise bad_request("prompt_embeds must not be empty", "prompt_embeds")
    if not ctx.front.prompt_embeds:
        raise bad_request("prompts given as embeddings need a server started with --enable-prompt-embeds",
                          "prompt_embeds")
    for field in ("echo", "use_beam_search"):
        if getattr(req, field):
            raise bad_request(f"{field} needs prompt tokens; prompts given as embeddings have none", field)
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs needs prompt tokens; prompts given as embeddings have none",
                          "prompt_logprobs")
    keep = ctx.keep_tokens(req)
    prompts = []
    for text in raw:
        value = await asyncio.to_thread(decode_base64, text)
        if value.layout != torch.strided:
            raise bad_request(f"prompt embeddings must be a dense tensor, got a "
                              f"{str(value.layout).removeprefix('torch.')} one", "prompt_embeds")
        if value.dim() not in (2, 3) or (value.dim() == 3 and value.shape[0] != 1):
            raise bad_request(f"prompt embeddings of shape {list(value.shape)}; give [positions, hidden_size]",
                              "prompt_embeds")
        value = value[0] if value.dim() == 3 else value
        if keep is not None and len(value) > keep:
            value = value[-keep:]
        prompts.append(_Prompt("", [], frozenset(), PromptEmbeds(value)))
    return prompts


async def _prompts(ctx: ServerContext, req: CompletionRequest) -> list[_Prompt]:
    """The request's prompts: those of ``prompt_embeds`` first (vLLM's order), then those of ``prompt``."""
    if req.prompt is None and req.prompt_embeds is None:
        raise bad_request("give a prompt (text or token ids) or prompt_embeds", "prompt")
    embedded = await _embeds_prompts(ctx, req) if req.prompt_embeds is not None else []
    raw = req.prompt
    if raw is None:
        check_choices(len(embedded), req.n)
        return embedded
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    check_choices(len(embedded) + len(raw), req.n)
    for p in raw:   # every prompt has a context of its own: each is checked before any is tokenized
        if isinstance(p, str):
            ctx.check_text(len(p), "prompt", req.truncate_prompt_tokens is not None)
    prompts = []
    special = req.add_special_tokens if req.add_special_tokens is not None else True
    tok = ctx.front.tokenizer
    for p in raw:
        if isinstance(p, str):
            ids = await ctx.tokenize(p, add_special_tokens=special, param="prompt",
                                     truncating=req.truncate_prompt_tokens is not None)
            kept = ctx.truncated(ids, req)
            text = p if len(kept) == len(ids) or tok is None else tok.decode(kept)
            added = None
            if special and text is p and req.echo and req.logprobs is not None:
                added = _added_positions(ids, await ctx.tokenize(p, add_special_tokens=False, param="prompt"))
            prompts.append(_Prompt(text, kept, frozenset() if not special or text is not p else added))
        else:
            ids = ctx.truncated(list(p), req)   # type: ignore[arg-type]
            ctx.check_token_ids(ids, "prompt")
            ctx.check_length(len(ids), None, "prompt")   # before echo decodes them
            text = tok.decode(ids) if (req.echo and tok is not None and ids) else ""
            prompts.append(_Prompt(text, ids, frozenset()))   # the text is the decode of every id
        if not prompts[-1].token_ids:
            raise bad_request("prompt must not be empty", "prompt")
    return embedded + prompts


class _TextOffsets:
    """Where each token starts in the text of a choice, in characters: a token's bytes advance the offset by the
    characters they complete, so a token that ends inside a UTF-8 character (a byte token, shown as
    ``bytes:\\xNN``) moves it only once the character is whole."""

    def __init__(self, start: int = 0, skipped: frozenset[int] = frozenset(),
                 skipped_positions: frozenset[int] = frozenset(), text: str | None = None) -> None:
        self.offset = start
        self.skipped = skipped   # tokens the text leaves out (special tokens, with skip_special_tokens)
        self.skipped_positions = skipped_positions   # positions (counted by advance) the text leaves out
        #: the text the offsets index, where known: a SentencePiece word start ("\u2581Hello") whose space the text
        #: lacks (a decoder strips the text's first one; the caller's prompt has none) advances past its word only
        self.text = text
        self._position = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _skips(self, token_id: int) -> bool:
        return token_id in self.skipped or self._position in self.skipped_positions

    def start(self, token_id: int, raw: bytes) -> int:
        """Where a token of bytes ``raw`` starts: after the replacement character of an unfinished character
        before it that ``raw`` cannot continue (its first byte is not a continuation byte)."""
        pending = self._decoder.getstate()[0]
        if pending and not self._skips(token_id) and raw and not 0x80 <= raw[0] <= 0xBF:
            self.offset += len(self._decoder.decode(b"", final=True))
            self._decoder.reset()
        return self.offset

    def advance(self, token_id: int, raw: bytes) -> None:
        if not self._skips(token_id):
            chars = self._decoder.decode(raw)
            if (self.text is not None and chars.startswith(" ") and not self.text.startswith(chars, self.offset)
                    and self.text.startswith(chars[1:], self.offset)):
                chars = chars[1:]
            self.offset += len(chars)
        self._position += 1


def _offsets(ctx: ServerContext, req: CompletionRequest, start: int) -> _TextOffsets:
    """Offsets into a choice's generated text, from ``start``."""
    return _TextOffsets(start, ctx.special_ids if req.skip_special_tokens else frozenset())


def _add_logprobs(ctx: ServerContext, dest: CompletionLogprobs, token_ids: Sequence[int],
                  positions: Sequence[PositionLogprobs | None], k: int, offsets: _TextOffsets,
                  name: Callable[[int], str]) -> None:
    """Append one entry per token to ``dest`` (tokens named by ``name``), ``offsets`` advanced past them. Each
    position's top log-probabilities hold the ``k`` most likely tokens and the chosen one (OpenAI: "up to
    logprobs + 1 elements")."""
    for tid, pos in zip(token_ids, positions, strict=True):
        dest.tokens.append(name(tid))
        chosen = pos.get(tid) if pos is not None else None
        dest.token_logprobs.append(json_logprob(chosen.logprob) if chosen is not None else None)
        top = None
        if pos is not None:
            top = {name(t): lp for t, lp in ctx.top_logprobs(pos, k)}
            if chosen is not None:
                top.setdefault(name(tid), json_logprob(chosen.logprob))
        dest.top_logprobs.append(top)
        raw = ctx.token_bytes(tid)
        dest.text_offset.append(offsets.start(tid, raw))
        offsets.advance(tid, raw)


def _added_positions(ids: list[int], plain: list[int]) -> frozenset[int] | None:
    """The positions of ``ids`` (a text tokenized with special tokens) around ``plain`` (the same text without
    them): what the tokenizer added; None when ``plain`` is not found in ``ids``."""
    for front in range(len(ids) - len(plain) + 1):
        if ids[front:front + len(plain)] == plain:
            return frozenset(range(front)) | frozenset(range(front + len(plain), len(ids)))
    return None


def _echo_logprobs(ctx: ServerContext, out: RequestOutput, k: int, name: Callable[[int], str],
                   prompt: _Prompt) -> CompletionLogprobs:
    """The prompt's entries of an echo. Offsets index ``prompt.text`` (what the choice's text starts with): special
    tokens the tokenizer added that the text does not hold (a BOS before the caller's string) take no characters,
    though the caller's text may hold the same token written out (``<s>Hello``)."""
    lp = CompletionLogprobs()
    positions = list(out.prompt_logprobs or [])
    positions += [None] * (len(out.prompt_token_ids) - len(positions))
    if prompt.added is not None:
        offsets = _TextOffsets(0, skipped_positions=prompt.added, text=prompt.text)
    else:
        offsets = _TextOffsets(0, frozenset(t for t in set(out.prompt_token_ids) & ctx.special_ids
                                            if ctx.token_text(t) not in prompt.text), text=prompt.text)
    _add_logprobs(ctx, lp, out.prompt_token_ids, positions[:len(out.prompt_token_ids)], k, offsets, name)
    return lp


def _choice(ctx: ServerContext, req: CompletionRequest, prompt: _Prompt, out: RequestOutput,
            c: CompletionOutput, index: int) -> CompletionChoice:
    text = (prompt.text if req.echo else "") + c.text
    logprobs = None
    name = ctx.token_namer(req)
    if req.logprobs is not None:
        logprobs = _echo_logprobs(ctx, out, req.logprobs, name, prompt) if req.echo else CompletionLogprobs()
        offsets = _offsets(ctx, req, len(prompt.text) if req.echo else 0)
        n = len(c.token_ids)
        _add_logprobs(ctx, logprobs, c.token_ids, (c.logprobs or [])[:n], req.logprobs, offsets, name)
    prompt_logprobs = (ctx.prompt_logprobs(out, req.prompt_logprobs, name)
                       if req.prompt_logprobs is not None else None)
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason=str(c.finish_reason) if c.finish_reason else None,
                            stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs)


def _usage(prompts: Sequence[_Prompt], completion_tokens: int, cached_tokens: int) -> UsageInfo:
    prompt_tokens = sum(p.length for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    created = int(time.time())   # when the request arrived (a stream stamps its chunks when it starts)
    lora = ctx.check_model(req.model)
    ctx.check_task("generate", "/v1/completions")
    ctx.note_ignored_fields(req)
    if (problem := req.unsupported()) is not None:
        raise bad_request(problem[1], problem[0])
    # echo with max_tokens 0: the prompt and its logprobs only (scoring a text, as lm-eval's loglikelihood does);
    # the engine samples one token, which the reply leaves out
    echo_only = req.echo and req.max_tokens == 0
    if echo_only and (req.stream or req.use_beam_search or req.min_tokens):
        field = "stream" if req.stream else "use_beam_search" if req.use_beam_search else "min_tokens"
        raise bad_request(f"max_tokens 0 (echo the prompt only) cannot be combined with {field}", field)
    prompts = await _prompts(ctx, req)
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    echo_k = max(asked) if asked else None
    defaults = ctx.default_sampling
    if "max_tokens" not in req.model_fields_set and ctx.default_max_tokens is not None:
        req.max_tokens = None   # the model's max_new_tokens (the context permitting) instead of OpenAI's 16
    params = sampling_params(lambda: req.sampling_params(1 if echo_only else req.max_tokens, req.logprobs,
                                                         prompt_logprobs=echo_k,
                                                         defaults=defaults), max_logprobs=ctx.front.max_logprobs)
    await check_structured(ctx, req, params)
    for p in prompts:
        ctx.check_length(p.length, 1 if echo_only else req.max_tokens, "prompt" if p.embeds is None
                         else "prompt_embeds", min_tokens=req.min_tokens or 0)
    rid = random_id("cmpl")
    if req.use_beam_search:
        return await _beam_search(ctx, req, rid, prompts, raw, lora, created)
    requests = [(f"{rid}-{i}", p.engine_prompt, params) for i, p in enumerate(prompts)]
    fields = ["prompt" if p.embeds is None else "prompt_embeds" for p in prompts]
    started = await unless_disconnected(raw, start(ctx, requests, req.priority, lora, fields,
                                                   cache_salt=req.cache_salt))
    events = merge(started)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage) or ctx.force_include_usage
        return SSEResponse(_stream(ctx, req, rid, prompts, params, events, include_usage, ctx.reply_model(lora)),
                           on_close=events.aclose)
    finals = await finish(raw, events, collect(events, len(prompts)))
    if echo_only:
        for out in finals:
            out.outputs = [CompletionOutput(c.index, "", [], 0.0, None, FinishReason.LENGTH) for c in out.outputs]

    def reply() -> Response:
        choices = [_choice(ctx, req, prompts[i], out, c, i * params.n + c.index)
                   for i, out in enumerate(finals) for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        body = CompletionResponse(id=rid, created=created, model=ctx.reply_model(lora), choices=choices,
                                  usage=_usage(prompts, completion_tokens, sum(o.num_cached_tokens for o in finals)))
        return JSONResponse(body.model_dump())

    if req.logprobs is None and req.prompt_logprobs is None:
        return reply()
    return await asyncio.to_thread(reply)   # large (prompts x n x tokens x logprobs): built off the event loop


async def _beam_search(ctx: ServerContext, req: CompletionRequest, rid: str, prompts: list[_Prompt],
                       raw: Request, lora: LoRARequest | None, created: int) -> Response:
    room = ctx.default_room(max(len(p.token_ids) for p in prompts))
    beam = beam_search_params(req, req.max_tokens, "max_tokens", room, ctx.front.max_logprobs)
    outs = await unless_disconnected(raw, ctx.beam_search(rid, [p.token_ids for p in prompts], beam, lora,
                                                           req.priority, req.cache_salt))
    choices = [CompletionChoice(index=i * req.n + j, text=(prompts[i].text if req.echo else "") + b.text,
                                finish_reason=b.finish_reason)
               for i, out in enumerate(outs) for j, b in enumerate(out.sequences)]
    completion_tokens = sum(len(b.token_ids) for out in outs for b in out.sequences)
    body = CompletionResponse(id=rid, created=created, model=ctx.reply_model(lora), choices=choices,
                              usage=_usage(prompts, completion_tokens, 0))
    return JSONResponse(body.model_dump())


@dataclasses.dataclass
class _ChoiceState:
    sent_chars: int = 0
    sent_tokens: int = 0
    offsets: _TextOffsets = dataclasses.field(default_factory=_TextOffsets)
    started: bool = False
    done: bool = False


async def _stream(ctx: ServerContext, req: CompletionRequest, rid: str, prompts: list[_Prompt],
                  params: SamplingParams, events: AsyncIterator[tuple[int, RequestOutput]],
                  include_usage: bool, model: str) -> AsyncIterator[str]:
    created = int(time.time())
    states = [_ChoiceState(offsets=_offsets(ctx, req, 0)) for _ in range(len(prompts) * params.n)]
    cached = [0] * len(prompts)
    k = req.logprobs
    name = ctx.token_namer(req)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    try:
        async for i, out in events:
            cached[i] = out.num_cached_tokens
            for c in out.outputs:
                index = i * params.n + c.index
                st = states[index]
                if st.done:
                    continue
                new_text = c.text[st.sent_chars:]
                end = len(c.token_ids)
                new_ids = c.token_ids[st.sent_tokens:end]
                prefix, lp = "", None
                if k is not None:
                    lp = CompletionLogprobs()
                if req.echo and not st.started:
                    prefix = prompts[i].text
                    if lp is not None:
                        lp = _echo_logprobs(ctx, out, k, name, prompts[i])  # type: ignore[arg-type]
                    st.offsets = _offsets(ctx, req, len(prefix))
                if lp is not None:
                    _add_logprobs(ctx, lp, new_ids, (c.logprobs or [])[st.sent_tokens:end], k,  # type: ignore[arg-type]
                                  st.offsets, name)
                finish = str(c.finish_reason) if c.finish_reason else None
                st.started = True
                st.sent_chars, st.sent_tokens = len(c.text), end
                st.done = finish is not None
                if not (prefix or new_text or finish or (lp is not None and new_ids)):
                    continue
                choice = CompletionChoice(index=index, text=prefix + new_text, logprobs=lp, finish_reason=finish,
                                          stop_reason=c.stop_reason if finish else None)
                usage = None
                if continuous:   # vLLM's: this choice's counts so far on every chunk
                    prompt_tokens = prompts[i].length
                    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=end,
                                      total_tokens=prompt_tokens + end)
                body = CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage)
                # "usage": null on each chunk only when the usage was asked for (as OpenAI)
                yield body.model_dump_json(exclude=None if include_usage else {"usage"})
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    if include_usage:
        usage = _usage(prompts, sum(st.sent_tokens for st in states), sum(cached))
        yield CompletionResponse(id=rid, created=created, model=model, choices=[],
                                 usage=usage).model_dump_json()
