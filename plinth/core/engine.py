"""LLMEngine: schedule -> execute -> sample -> update -> outputs, one step at a time."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import numbers
import operator
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from plinth.config import EngineConfig, SpeculativeConfig
from plinth.core.async_engine import EngineDeadError
from plinth.core.block_manager import BlockManager
from plinth.core.detokenizer import IncrementalDetokenizer
from plinth.core.draft_model import DraftProposer
from plinth.core.logits_processors import check_request, resolve_processors
from plinth.core.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    ClassifierHead,
    EmbeddingOutput,
    PoolingConfig,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    PoolState,
    finish_embedding,
    finish_embeddings,
    kept_tokens,
    resolve_pooling,
)
from plinth.core.prompt_embeds import PLACEHOLDER_ID, PromptEmbeds
from plinth.core.request import (
    CompletionOutput,
    FinishReason,
    PositionLogprobs,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    cache_salt_problem,
    encodable_text,
)
from plinth.core.sampler import SamplingBatchBuilder, compute_prompt_logprobs
from plinth.core.sampling_batch import splitmix64
from plinth.core.scheduler import RequestRejectedError, Scheduler, SchedulerOutput
from plinth.core.speculative import NgramProposer, SpeculativeStats, accepted_tokens, speculates
from plinth.core.step_cost import StepCostModel
from plinth.core.structured import PARAM as STRUCTURED_PARAM
from plinth.core.structured import (
    AfterReasoning,
    GrammarCompiler,
    ReasoningMarkers,
    StructuredOutputError,
    allowed_tokens,
    reasoning_markers,
)
from plinth.distributed.executor import Executor, PendingStep, UniprocExecutor
from plinth.errors import EngineSleepingError, LoRAAdapterError, ModelLoadError, SleepModeError
from plinth.lora.adapter import LoRAAdapter, adapter_targets, load_adapter
from plinth.lora.request import LoRARequest
from plinth.lora.slots import LoRASlotTable
from plinth.model_registry.registry import ModelRegistry
from plinth.worker.batching import BatchBuilder
from plinth.worker.model_runner import ModelRunner
from plinth.worker.sleep import SLEEP_TAGS

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Sequence:
    """Engine-side state of one sampled sequence (a scheduler Request plus its text)."""

    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None


@dataclasses.dataclass
class _Group:
    """One user request: ``n`` sequences sharing a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    aborted: bool = False
    lora_request: Any = None
    error: str | None = None   # why the engine ended it (a custom logits processor failed on it)
    num_prompt_embeds: int = 0   # a prompt given as embeddings: its positions (prompt_token_ids is empty)

    @property
    def finished(self) -> bool:
        return self.aborted or all(s.request.is_finished for s in self.seqs)


#: an embedding request's rows of a step: (its state, its first position, the step's flat rows [start, stop))
_PoolSpan = tuple[PoolState, int, int, int]


@dataclasses.dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet (asynchronous scheduling)."""

    out: SchedulerOutput
    reqs: list[Request]        # the requests it samples, in row order
    step: PendingStep
    rows: dict[str, int]       # request id -> row of its token in the step's output
    pooled: list[_PoolSpan] | None = None   # the embedding requests' rows it computes (see LLMEngine._pool_spans)


#: the pooling tasks that give one row per prompt position
_TOKEN_TASKS = ("token_embed", "token_classify")

#: a pooling request's sampling: its prompt's prefill, then one token (dropped); checked once, as it is made
_POOLING_STEP = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

#: the floor of ``LLMEngine.chars_per_token`` (real text has a few characters per token)
MIN_CHARS_PER_TOKEN = 64


def _token_ids(prompt: Any) -> list[int]:
    """A token-id prompt as a list of ints (numpy and torch integers too; not floats, strings or bools)."""
    if type(prompt) is list and set(map(type, prompt)) <= {int}:   # (the common case, without a per-token call)
        return list(prompt)
    try:
        items = list(prompt) if not isinstance(prompt, bytes) else []
        ids = [operator.index(t) for t in items if not isinstance(t, bool)]
        ok = len(ids) == len(items) and not isinstance(prompt, bytes)
    except TypeError:
        ok = False
    if not ok:
        raise RequestRejectedError(f"a prompt is text or a list of token ids (integers), got {type(prompt).__name__} "
                                   "holding something else")
    return ids


def _child_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` (> 0) of a seeded request with ``n > 1``: a hash of both, so that the
    samples of requests with nearby seeds do not coincide (sample 0 keeps the request's seed)."""
    value = splitmix64(np.array([(seed ^ (index * 0x9E3779B97F4A7C15)) & (2**64 - 1)], dtype=np.uint64))
    return int(value[0] >> np.uint64(1))


def _needs_sync_steps(params: SamplingParams) -> bool:
    """Whether the request needs every earlier token on the host before a step is built: penalties
    count the output tokens, prompt logprobs read the step's hidden states, a grammar's next tokens
    depend on the last one. Such requests run with synchronous steps. (Seeded rows and ``min_tokens``
    count the token in flight as an output; logprobs come back with the tokens.)"""
    return (params.prompt_logprobs is not None or params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or params.structured_outputs is not None or bool(params.bad_words))


#: ``apply_chat_template`` arguments that ``render_chat`` sets itself (or that would make it return something else
#: than the rendered text): not template variables, so not accepted among ``template_kwargs``
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _parts(content: str) -> tuple[str, ...]:
    return content.parts if isinstance(content, TextParts) else (content,)


class TextParts(str):
    """A message's text content parts joined by line breaks (as vLLM joins them for chat templates that read a
    string), keeping the parts (``parts``) for templates that loop over them."""

    parts: tuple[str, ...]

    def __new__(cls, parts: Sequence[str]) -> TextParts:
        joined = super().__new__(cls, "\n".join(parts))
        joined.parts = tuple(parts)
        return joined

    def __reduce__(self) -> tuple[Any, ...]:   # copies and pickles are built from the parts, not the text
        return TextParts, (self.parts,)


class ImagePart(str):
    """An image content part among a message's :class:`TextParts`: the model's image token as text (what a template
    that reads plain strings sees), or ``{"type": "image"}`` for a template that loops over content parts."""


class VideoPart(str):
    """A video content part (Qwen2-VL): the model's video token as text, or ``{"type": "video"}`` for a template
    that loops over content parts."""


def _template_part(part: str) -> dict[str, str]:
    if isinstance(part, ImagePart):
        return {"type": "image"}
    return {"type": "video"} if isinstance(part, VideoPart) else {"type": "text", "text": part}


@functools.lru_cache(maxsize=16)
def template_iterates_content(template: str) -> bool:
    """Whether a chat template loops over a message's ``content`` (``{% for part in message['content'] %}``, or over
    a variable set from it): it reads OpenAI's list of content parts, and a string there would be looped over
    character by character, so messages reach it with their text as one ``{"type": "text"}`` part."""
    import re

    import jinja2
    from jinja2 import nodes

    # transformers' {% generation %} blocks (assistant-token masks) are not jinja2's: the text between them is kept
    plain = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(plain)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node: nodes.Node) -> bool:
        while isinstance(node, nodes.Filter | nodes.Test):   # message['content'] | selectattr('type', ...)
            node = node.node
        return ((isinstance(node, nodes.Getattr) and node.attr == "content")
                or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"))

    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and is_content(a.node)}
    return any(is_content(loop.iter) or (isinstance(loop.iter, nodes.Name) and loop.iter.name in names)
               for loop in tree.find_all(nodes.For))


class LLMEngine:
    """The engine core, used in-process by ``plinth.LLM`` and by the server's engine loop.

    Args:
        config: the engine configuration.
        executor_factory: optional ``factory(config) -> Executor`` that runs the model in worker
            processes (default: chosen from ``config.parallel``; see ``plinth.distributed``).
    """

    def __init__(self, config: EngineConfig, executor_factory: Callable[[EngineConfig], Executor] | None = None):
        from plinth.entrypoints.openai.reasoning_parsers import resolve_reasoning_parser
        from plinth.worker.setup import build_engine_parts, decode_rows, whole_image_positions

        t0 = time.perf_counter()
        reasoning = resolve_reasoning_parser(config.model.reasoning_parser)   # a bad name fails before the model loads
        #: the custom logits processor classes (:mod:`plinth.core.logits_processors`)
        self.logits_processors = resolve_processors(config.model.logits_processors)
        parts = build_engine_parts(config, executor_factory)
        self.config = config = parts.config or config   # scheduler limits resolved for the platform
        if parts.source.encoder:   # (inputs run whole, without the prefix cache)
            from plinth.worker.setup import encoder_settings

            self.config = config = encoder_settings(config, parts.max_model_len, parts.platform.device_type)
        self.platform = parts.platform
        self.model_source = parts.source
        self.tokenizer = parts.tokenizer
        self.chat_template = parts.chat_template
        self.dtype = parts.dtype
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        self.eos_token_ids = parts.eos_token_ids
        #: the model's generation-config sampling defaults (see :meth:`default_sampling_params`), and its
        #: ``max_new_tokens``: the most a request without ``max_tokens`` generates (the context's end permitting)
        self.default_sampling: dict[str, Any] = dict(parts.default_sampling)
        self.default_max_tokens: int | None = self.default_sampling.pop("max_tokens", None)
        self.selection = parts.selection
        self.runner: ModelRunner | None = parts.runner   # None when worker processes own the model
        self.executor: Executor = parts.executor or UniprocExecutor(parts.runner, parts.num_blocks, parts.selection,
                                                                        seed=config.model.seed,
                                                                        processors=self.logits_processors,
                                                                        logprobs_mode=config.model.logprobs_mode)
        #: whether logprobs are logits (the ``raw_logits`` and ``processed_logits`` modes)
        self.logprobs_as_logits = config.model.logprobs_mode.endswith("_logits")
        self._dead: EngineDeadError | None = None
        #: sleep mode: the parts asleep (:data:`~plinth.worker.sleep.SLEEP_TAGS`); whether a level-2 sleep
        #: discarded the weights and no update_weights() has brought them since
        self._asleep: set[str] = set()
        self._weights_discarded = False
        #: ``generate``, ``embed`` or ``classify`` (the last two: :meth:`add_request` takes PoolingParams)
        self.task = config.model.task
        self.pooling = (resolve_pooling(parts.source.path, config.model.pooling, config.model.normalize_embeddings,
                                        "cls" if parts.source.encoder else "last")
                        if self.task == "embed" else None)
        #: a sequence classifier's head (``task="classify"``), applied to each prompt's last hidden state
        self.classifier: ClassifierHead | None = None
        if self.task == "classify":
            from plinth.model_registry.loader import load_classifier_head

            encoder, per_token = parts.source.encoder, parts.source.token_classifier
            self.classifier = ClassifierHead.of(parts.source.hf_config,
                                                *load_classifier_head(parts.source, config.model.seed, parts.tokenizer),
                                                encoder=encoder, per_token=per_token)
            # (an encoder's head reads the first token, which has seen every token, or the mean: ModernBERT's
            # classifier_pooling; a token classifier's every position)
            kind = (getattr(parts.source.hf_config, "classifier_pooling", None) or "cls") if encoder else "last"
            if encoder and kind not in ("cls", "mean") and not per_token:
                raise ModelLoadError(f"classifier_pooling {kind!r}: plinth pools a classifier's cls token or mean")
            self.pooling = PoolingConfig("all" if per_token else kind, False,
                                         "the token classifier" if per_token else "the sequence classifier")
            logger.info("%s classifier: %d labels (%s), %s", "token" if per_token else "sequence",
                        len(self.classifier.labels),
                        ", ".join(self.classifier.labels[:8]) + (" ..." if len(self.classifier.labels) > 8 else ""),
                        self.classifier.activation)
        self.hidden_size: int = int(getattr(parts.source.hf_config, "hidden_size", 0) or 0)
        #: an encoder-only model (BERT, ...): inputs run whole, and truncation keeps their beginning
        self.encoder: bool = parts.source.encoder
        #: the token types (segments) an input may use (``token_type_ids``): an encoder's ``type_vocab_size``;
        #: 0 for a decoder, which has none
        self.num_token_types = (max(int(getattr(parts.source.hf_config, "type_vocab_size", 1) or 1), 1)
                                if self.encoder else 0)
        self.special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", None) or ())
        #: prompts may be given as embeddings (``enable_prompt_embeds``)
        self.prompt_embeds = bool(config.model.enable_prompt_embeds)
        #: image inputs (a LLaVA checkpoint): the processor and the placeholder rules, else ``None``
        self.images: Any = None
        self._image_epoch = 0   # counts prefix-cache resets: part of every image's cache key
        if getattr(parts.source, "mm_config", None) is not None:
            from plinth.multimodal.images import (
                MAX_IMAGES_PER_PROMPT,
                MAX_VIDEOS_PER_PROMPT,
                ImageSupport,
                MediaPolicy,
            )

            model_cfg = config.model
            limits = model_cfg.limit_mm_per_prompt or {}
            self.images = ImageSupport(parts.source.mm_config, parts.source.path, parts.tokenizer,
                                       MAX_IMAGES_PER_PROMPT if limits.get("image") is None else limits["image"],
                                       MediaPolicy(model_cfg.allowed_local_media_path,
                                                   model_cfg.allowed_media_domains or ()),
                                       processor_kwargs=model_cfg.mm_processor_kwargs, dtype=parts.dtype,
                                       video_limit=(MAX_VIDEOS_PER_PROMPT if limits.get("video") is None
                                                    else limits["video"]))
            self.images.max_positions = self.max_model_len
        prefix_caching = config.cache.enable_prefix_caching
        if self.pooling is not None and self.classifier is None:
            logger.info("embedding model: %s pooling%s (from %s)", self.pooling.kind,
                        ", normalized" if self.pooling.normalize else "", self.pooling.origin)
            if self.pooling.kind != "last" and prefix_caching:   # (a request for token embeddings skips it alone)
                logger.info("%s pooling needs every prompt position computed: the prefix cache is off",
                            self.pooling.kind)
                prefix_caching = False
        #: the model keeps per-sequence recurrent state (Mamba layers): no speculative decoding, and the prefix
        #: cache needs its states kept at block boundaries (checkpoint slots)
        self.has_recurrent_state = _has_recurrent_state(parts)
        state_slots = 0
        if self.has_recurrent_state:
            if config.speculative.enabled:
                from plinth.config import ConfigError

                raise ConfigError(f"speculative decoding is not supported for {parts.source.architecture}: its Mamba "
                                  "layers' state cannot be taken back past rejected drafts")
            if prefix_caching:
                state_slots = _state_slots(parts)
                if not state_slots:
                    logger.info("%s keeps per-sequence state in its Mamba layers and no prefix-cache states "
                                "(--mamba-cache-slots 0, or none fit): the prefix cache is off", parts.source.architecture)
                    prefix_caching = False
        self.block_manager = BlockManager(parts.num_blocks, config.cache.block_size, prefix_caching, state_slots)
        lora = config.lora
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   max_loras=lora.max_loras if lora.enable_lora else 0)
        budget = self.scheduler.config.max_num_batched_tokens
        whole = whole_image_positions(parts.source, config)
        if whole:   # (Gemma 3: an image's positions see the whole image)
            seqs = self.scheduler.config.max_num_seqs * decode_rows(config)   # (decodes' tokens, drafts included)
            if budget < whole:
                from plinth.config import ConfigError

                raise ConfigError(f"max_num_batched_tokens ({budget}) is below the {whole} positions of one image, "
                                  "which Gemma 3 prefills in one step (an image's positions attend to each other): "
                                  "raise the budget, or turn images off with limit_mm_per_prompt {\"image\": 0}")
            if budget < whole + seqs:
                logger.warning("max_num_batched_tokens (%d) leaves less than an image's %d positions beside the %d "
                               "tokens of a full batch of decodes: an image prompt may wait, holding new requests "
                               "back, until fewer requests decode (%d or more avoids it)", budget, whole, seqs,
                               whole + seqs)
                self.scheduler.hold_for_images = True
            self.scheduler.whole_images = whole
        if not self.scheduler.config.enable_chunked_prefill and budget < self.max_model_len:
            logger.warning("max_num_batched_tokens (%d) is below max_model_len (%d) with chunked prefill off: prompts "
                           "longer than %d tokens will be refused; raise the budget or enable chunked prefill",
                           budget, self.max_model_len, budget)
        #: LoRA adapters read so far, least recently used first (at most ``lora.cpu_cache_size``); every id ever
        #: used, with the (name, path) it stands for: an id keeps naming the same adapter (its prefix-cache entries
        #: and its device slot are keyed by it); a lock, as a server reads adapters outside the engine's thread
        self._adapters: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._live_adapters: weakref.WeakValueDictionary[int, LoRAAdapter] = weakref.WeakValueDictionary()
        self._lora_names: dict[int, tuple[str, str]] = {}
        self._retired_loras: set[int] = set()   # ids :meth:`remove_lora` took back: never read again
        self._lora_lock = threading.Lock()
        cache_tokens = self.block_manager.num_usable_blocks * config.cache.block_size
        #: the longest sequence the engine can hold: max_model_len, or less when the KV cache holds less (the last
        #: sampled token needs no slot)
        self.max_sequence_len = min(self.max_model_len, cache_tokens + 1)
        if cache_tokens < self.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len (%d): a request gets at most "
                           "that many in all (without max_tokens it stops there); give the cache more memory or "
                           "lower --max-model-len", cache_tokens, self.max_model_len)
        self.device = parts.device
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, _Group] = {}
        self._seqs: dict[str, _Sequence] = {}
        self._aborted: list[_Group] = []
        #: aborted requests not reported yet whose id a new request took (reported by the next step)
        self._superseded: list[_Group] = []
        self._prompt_logprob_groups: set[str] = set()   # unfinished groups that asked for prompt logprobs
        self._sync_groups: set[str] = set()   # unfinished groups whose sampling needs synchronous steps
        self._in_flight: _InFlight | None = None   # asynchronous scheduling: the step not read back yet
        self.speculative: SpeculativeStats | None = None
        #: the draft model's proposer (speculative method ``draft_model``)
        self.draft: DraftProposer | None = None
        if config.speculative.enabled:
            self._enable_speculation(config.speculative, parts.draft_runner)
        self.async_scheduling = self._resolve_async(config.scheduler.async_scheduling)
        self.itl_target_ms = self._resolve_itl_target(config.scheduler.itl_target_ms)
        self.step_cost: StepCostModel | None = None
        if self.itl_target_ms:
            cost = self.step_cost = StepCostModel()
            target_s = self.itl_target_ms / 1e3
            self.scheduler.prefill_allowance = lambda decodes: cost.prefill_allowance(decodes, target_s)
        self._batch_builder = BatchBuilder(min(-(-self.max_model_len // config.cache.block_size), parts.num_blocks),
                                           config.scheduler.max_num_seqs, keep_hidden=self.pooling is not None)
        if self.speculative is not None and self.runner is not None and self.runner.shared_decode_rows:
            # the attention backend lets a sequence's token and drafts go as rows of a decode step (a CPU decode
            # plan, a replayed graph); at most the rows the decode plan runs in one call, or the largest graph
            self._batch_builder.drafts_as_rows = True
            graphs = self.runner.graphs
            rows = getattr(graphs, "fused_max_rows", 0) or getattr(graphs, "max_size", 0)
            if rows:
                self.scheduler.max_decode_rows = rows
        self._batch_builder.carries_state_rows = self.has_recurrent_state
        if lora.enable_lora:
            self._batch_builder.lora_slots = LoRASlotTable(lora.max_loras)
            self._batch_builder.running = functools.partial(getattr, self.scheduler, "running")
        self._sampling = SamplingBatchBuilder(self.vocab_size, self.logits_processors)
        self._grammars: GrammarCompiler | None = None   # structured outputs, made on the first such request
        self._reasoning = self._reasoning_markers(reasoning)
        self.served_model_name = config.model.served_model_name or parts.model_name
        self.served_model_aliases: tuple[str, ...] = config.model.served_model_aliases
        #: without a served name, the model argument as given (a path, as vLLM serves it by default) names it too
        self.model_argument: str | None = (config.model.model if config.model.served_model_name is None
                                           and isinstance(config.model.model, str) else None)
        # (-1, no limit: as many as any request may ask for)
        self.max_logprobs: int = config.model.max_logprobs if config.model.max_logprobs != -1 \
            else SamplingParams.LOGPROBS_CEILING
        if config.cache.kv_cache_dtype != "auto":
            self._note_kv_cache_dtype()
        self.load_time_s = time.perf_counter() - t0
        logger.info("engine ready in %.2f s: %s, %s, %s, attention %s, %d KV blocks%s", self.load_time_s,
                    parts.model_name, self.platform.name, str(self.dtype).removeprefix("torch."),
                    self.selection.winner if self.selection else "?", parts.num_blocks,
                    ", asynchronous scheduling" if self.async_scheduling else "")

    def _note_kv_cache_dtype(self) -> None:
        """Say what a KV cache narrower than the model's dtype costs here: an 8-bit cache's scale of 1 (no
        calibration), and a torch reference backend where the fast ones cannot read it (decode then runs without
        graphs or the CPU decode plan)."""
        from plinth.attention_backends.interface import kv_cache_torch_dtype

        kind = self.config.cache.kv_cache_dtype
        if kv_cache_torch_dtype(kind, self.dtype) == self.dtype:
            return   # the model's own dtype (bfloat16 for a bfloat16 model)
        if kind == "bfloat16":
            logger.info("--kv-cache-dtype bfloat16: keys and values rounded to bfloat16 (the model computes in %s)",
                        str(self.dtype).removeprefix("torch."))
        else:
            logger.warning("--kv-cache-dtype %s: keys and values rounded to 8 bits with a scale of 1 (no calibrated "
                           "scales); accuracy may drop", kind)
        selection = self.selection
        if selection is None or selection.winner not in ("torch_sdpa", "torch_batched"):
            return
        refused = [f"{c.name}: {c.reason}" for c in selection.candidates if c.reason and not c.chosen]
        logger.warning("--kv-cache-dtype %s runs on the %s attention backend, slower than the backends that keep the "
                       "model's dtype (%s); --kv-cache-dtype auto keeps them", kind, selection.winner,
                       "; ".join(refused) or "none refused")

    def _enable_speculation(self, spec: SpeculativeConfig, draft_runner: ModelRunner | None) -> None:
        """Let the scheduler give decodes draft tokens (``ngram``: prompt lookup over each sequence's tokens;
        ``draft_model``: a draft model's greedy tokens)."""
        self.speculative = SpeculativeStats()
        if spec.speculative_method == "draft_model":
            assert draft_runner is not None, "a draft_model engine built without its draft runner"
            self.draft = DraftProposer(draft_runner, self.scheduler, spec.num_speculative_tokens,
                                       self.block_manager.num_blocks)
            self.scheduler.proposer = self.draft.propose
            logger.info("speculative decoding: up to %d draft tokens from the draft model %s",
                        spec.num_speculative_tokens, spec.speculative_model)
            return
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

        def propose(req: Request, limit: int) -> list[int]:
            return proposer.propose_for(req, limit) if speculates(req) else []

        self.scheduler.proposer = propose
        logger.info("speculative decoding: %s, up to %d draft tokens (n-grams of %d-%d tokens)",
                    spec.speculative_method, spec.num_speculative_tokens, spec.prompt_lookup_min,
                    spec.prompt_lookup_max)

    def _resolve_itl_target(self, requested: float) -> float:
        """The inter-token latency target in ms (0: off). Asynchronous steps are not timed one by one,
        so they keep no target."""
        if requested and self.async_scheduling:
            logger.warning("itl_target_ms applies to synchronous steps; with asynchronous scheduling it is off")
            return 0.0
        if requested and not self.config.scheduler.enable_chunked_prefill:
            logger.warning("itl_target_ms needs chunked prefill (a prompt cannot be split to fit); it is off")
            return 0.0
        return float(requested)

    def _resolve_async(self, requested: bool | None) -> bool:
        """Whether steps are scheduled asynchronously: as asked, else on where the executor supports it and
        the model runs on an accelerator (in this process, or in TP-only worker processes)."""
        supported = self.executor.supports_async_steps
        if self.speculative is not None:   # a step's drafts come from the tokens of the step before
            if requested:
                logger.warning("asynchronous scheduling is off with speculative decoding (each step's drafts "
                               "need the previous step's tokens)")
            return False
        if requested is None:
            device_type = getattr(self.platform, "device_type", None) if self.runner is None else (
                torch.device(self.device).type if self.device is not None else None)
            return supported and device_type is not None and device_type != "cpu"
        if requested and not supported:
            logger.warning("asynchronous scheduling is not available with %s; steps run synchronously",
                           type(self.executor).__name__)
            return False
        return requested

    # ----------------------------------------------------------------------------------- requests

    def tokenize(self, prompt: str, add_special_tokens: bool = True, max_chars: int | None = None) -> list[int]:
        """Token ids of ``prompt``.

        Args:
            max_chars: the longest text tokenized (default: what the context could hold whatever its tokens; a
                caller that keeps only the last tokens, such as the server's ``truncate_prompt_tokens``, allows more).

        Raises:
            RequestRejectedError: text that is not valid Unicode (a lone surrogate), or longer than the
                context could hold whatever its tokens (checked before tokenizing it).
        """
        return list(self._encode([prompt], add_special_tokens, max_chars, None)["input_ids"])

    def tokenize_pair(self, first: str, second: str, add_special_tokens: bool = True, max_chars: int | None = None,
                      max_tokens: int | None = None) -> tuple[list[int], list[int] | None]:
        """Two texts tokenized as a pair (the tokenizer's pair template, as a cross-encoder reads its query and
        document): their token ids, and the token types the tokenizer gives them where the model reads segments
        (BERT: 0 for ``[CLS] first [SEP]``, 1 for ``second [SEP]``; else ``None``). ``max_chars`` applies to both texts
        together; ``max_tokens`` cuts the pair as the tokenizer cuts one (``truncation="longest_first"``: the longer
        text first, both keeping their beginning).

        Raises:
            RequestRejectedError: as :meth:`tokenize`, or ``max_tokens`` too few for the pair's special tokens.
        """
        encoded = self._encode([first, second], add_special_tokens, max_chars, max_tokens)
        ids = list(encoded["input_ids"])
        if max_tokens is not None and len(ids) > max_tokens:   # the template's special tokens alone exceed it
            raise RequestRejectedError(f"truncate_prompt_tokens is {max_tokens}: too few for the pair's special "
                                       f"tokens", param="truncate_prompt_tokens")
        types = encoded.get("token_type_ids") if self.num_token_types > 1 else None
        return ids, list(types) if types is not None else None

    def _encode(self, texts: list[str], add_special_tokens: bool, max_chars: int | None,
                max_tokens: int | None) -> Any:
        """The tokenizer's encoding of one text or a pair, after the checks of :meth:`tokenize`."""
        if self.tokenizer is None:
            raise RequestRejectedError("this model has no tokenizer (its directory has no tokenizer files and none was "
                                       "given): pass token ids, or give a tokenizer (tokenizer= / --tokenizer)")
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise RequestRejectedError(f"a prompt is text or a list of token ids, not {type(bad).__name__}")
        per_token = self.chars_per_token
        length = sum(len(t) for t in texts)
        if max_chars is not None and length > max_chars:
            raise RequestRejectedError(f"the prompt has {length} characters, more than {max_chars}")
        if max_chars is None and length > per_token * self.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {length} characters, more than {per_token} (the longest token) per token of "
                f"this model's context of {self.max_model_len} tokens")
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestRejectedError(f"the prompt is not valid Unicode text: {exc.reason} at character "
                                           f"{exc.start}") from None
        if max_tokens is None:
            return self.tokenizer(*texts, add_special_tokens=add_special_tokens)
        return self.tokenizer(*texts, add_special_tokens=add_special_tokens, truncation="longest_first",
                              max_length=max_tokens)

    @functools.cached_property
    def chars_per_token(self) -> int:
        """The most characters one token can stand for: the vocabulary's longest entry (a vocabulary entry is
        at least as long as the text its token stands for), at least :data:`MIN_CHARS_PER_TOKEN`."""
        try:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=0) if self.tokenizer else 0
        except (AttributeError, TypeError, NotImplementedError):
            longest = 0
        return max(MIN_CHARS_PER_TOKEN, longest)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
        """Format a conversation with the chat template (rendered by transformers' sandboxed jinja2); ``tools``
        (OpenAI's function definitions) are handed to templates that describe tools to the model.
        ``continue_final_message``: the last message is left open for the reply to go on (no end-of-turn
        after it); ``template_kwargs``: more variables for the template (e.g. Qwen3's ``enable_thinking``).

        Raises:
            ValueError: no tokenizer or template, or reserved ``template_kwargs``.
            jinja2.TemplateError: the template failed (any error raised while it renders).
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict of the template's variables, got "
                            f"{type(template_kwargs).__name__}")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
        if reserved:
            raise ValueError(f"template_kwargs may not set {', '.join(reserved)} (arguments of their own)")
        template = chat_template or self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the model has no chat template; pass one with --chat-template")
        import jinja2

        chosen = template if template is not None else self.tokenizer.chat_template
        if isinstance(chosen, dict):   # named templates: the one transformers picks
            chosen = chosen.get("tool_use") if tools and "tool_use" in chosen else chosen.get("default")
        content_format = self.config.model.chat_template_content_format
        if content_format == "openai" or (content_format == "auto" and isinstance(chosen, str)
                                          and template_iterates_content(chosen)):   # it reads OpenAI's content parts
            messages = [{**m, "content": [_template_part(part) for part in _parts(m["content"])]}
                        if isinstance(m.get("content"), str) else m for m in messages]
        else:   # (plain strings: the template sees no subclass)
            messages = [{**m, "content": str(m["content"])} if isinstance(m.get("content"), TextParts) else m
                        for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template,
                tools=tools or None, continue_final_message=continue_final_message, **(template_kwargs or {}))
        except (jinja2.TemplateError, ValueError):   # the template's raise_exception, transformers' own checks
            raise
        except Exception as exc:   # the template's expressions failed (str + int, a division by zero, recursion)
            raise jinja2.TemplateError(f"{type(exc).__name__}: {exc}") from exc

    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check a LoRA adapter (kept in host memory for the requests that name it); a request naming
        it later finds it read. Requests name adapters with ``add_request(..., lora_request=...)``. Safe to call
        from another thread than the one stepping the engine (the adapter is read outside the engine's lock).

        Raises:
            RequestRejectedError: LoRA adapters are not enabled, the id names another adapter already, or the
                adapter cannot be served (param ``lora_request``; the message says why).
        """
        if not isinstance(lora_request, LoRARequest):
            raise RequestRejectedError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                                       param="lora_request")
        if not self.config.lora.enable_lora:
            raise RequestRejectedError("LoRA adapters are not enabled: start the engine with enable_lora=True "
                                       "(--enable-lora)", param="lora_request")
        lora_id = lora_request.lora_int_id
        with self._lora_lock:
            self._check_lora_id(lora_request)
            adapter = self._adapters.get(lora_id)
            if adapter is not None:
                self._adapters.move_to_end(lora_id)
                return adapter
            adapter = self._live_adapters.get(lora_id)   # dropped from the cache, still held by running requests
            if adapter is not None:
                if lora_id not in self._retired_loras:
                    self._keep(adapter)
                return adapter
            self._check_not_retired(lora_request)
        try:
            adapter = load_adapter(lora_request.lora_name, lora_id, lora_request.lora_path,
                                   self.model_source.hf_config, self.config.lora.max_lora_rank,
                                   adapter_targets(ModelRegistry.resolve(self.model_source.architecture)))
        except LoRAAdapterError as exc:
            raise RequestRejectedError(str(exc), param="lora_request") from None
        with self._lora_lock:
            self._check_lora_id(lora_request)
            self._check_not_retired(lora_request)   # removed while its files were read
            self._lora_names[lora_id] = (lora_request.lora_name, lora_request.lora_path)
            self._keep(adapter)
        logger.info("LoRA adapter %r (id %d, rank %d, %d modules, %.1f MiB) read from %s", adapter.name,
                    lora_id, adapter.rank, len(adapter.modules), adapter.nbytes / 2**20, adapter.path)
        return adapter

    def has_lora(self, lora_int_id: int) -> bool:
        """Whether the adapter is read and in host memory (naming it costs a lookup, no file reads)."""
        return lora_int_id in self._adapters

    def _keep(self, adapter: LoRAAdapter) -> None:
        """Into the host cache (the lock held), dropping the least recently used beyond its size (requests running
        with a dropped one keep their reference, through which a new request finds it too)."""
        self._adapters[adapter.lora_id] = adapter
        self._live_adapters[adapter.lora_id] = adapter
        while len(self._adapters) > self.config.lora.cpu_cache_size:
            self._adapters.popitem(last=False)

    def _check_lora_id(self, lora_request: LoRARequest) -> None:
        known = self._lora_names.get(lora_request.lora_int_id)
        if known is not None and known != (lora_request.lora_name, lora_request.lora_path):
            raise RequestRejectedError(
                f"lora_int_id {lora_request.lora_int_id} names adapter {known[0]!r} ({known[1]}) already; give "
                f"{lora_request.lora_name!r} ({lora_request.lora_path}) another id", param="lora_request")

    def _check_not_retired(self, lora_request: LoRARequest) -> None:
        if lora_request.lora_int_id in self._retired_loras:
            raise RequestRejectedError(f"LoRA adapter {lora_request.lora_name!r} (id {lora_request.lora_int_id}) "
                                       "was removed", param="lora_request")

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter: it leaves host memory once nothing holds it. Requests running with it, or
        holding it (:meth:`lora_adapter`), finish with it; its id is retired: it is never read again, and a request
        naming it without holding it is refused. Returns whether it was in the host cache."""
        with self._lora_lock:
            self._retired_loras.add(lora_int_id)
            return self._adapters.pop(lora_int_id, None) is not None

    def lora_adapter(self, lora_int_id: int) -> LoRAAdapter | None:
        """The adapter of ``lora_int_id`` if it is in memory (the host cache, or held by a request), else None; no
        file is read. Holding it keeps it usable for requests after :meth:`remove_lora`."""
        with self._lora_lock:
            return self._adapters.get(lora_int_id) or self._live_adapters.get(lora_int_id)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | PromptEmbeds,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None, cache_salt: str | None = None,
                    multi_modal_data: dict[str, Any] | None = None,
                    token_type_ids: Sequence[int] | None = None) -> None:
        """Queue a request. ``priority`` (the ``priority`` scheduling policy only): lower runs first.
        An embedding engine (``task="embed"``) takes :class:`~plinth.core.pooling.PoolingParams` (or none);
        its outputs are :class:`~plinth.core.pooling.PoolingRequestOutput` (a classifier's, ``task="classify"``,
        :class:`~plinth.core.pooling.ClassificationRequestOutput`). ``lora_request``: a LoRA adapter to
        run the request with (an engine with ``enable_lora``; see :meth:`add_lora`). ``cache_salt`` (vLLM's): the
        request reuses, and offers, cached KV blocks only among requests given the same salt, so that tenants
        that do not share a salt cannot learn each other's prompts from cache hits (their timing).
        ``multi_modal_data`` (an image-and-text model: ``{"image": image or [images]}``, PIL images or image files'
        bytes): the images the prompt's image tokens stand for, one token each (see :mod:`plinth.multimodal`).
        ``prompt`` may be an :class:`~plinth.core.prompt_embeds.PromptEmbeds`: the prompt as its input embeddings (an
        engine with ``enable_prompt_embeds``); its output's ``prompt_token_ids`` is then empty.
        ``token_type_ids`` (an encoder: vLLM's ``TokensPrompt`` field): each prompt token's segment, as a BERT
        tokenizer gives a text pair (``[CLS] a [SEP]`` type 0, ``b [SEP]`` type 1); without it every token's is 0.

        Raises:
            RequestRejectedError: the prompt is empty or too long, a token id (of the prompt, ``logit_bias``,
                ``allowed_token_ids``) is not in the vocabulary, the id is in use, a
                priority without the priority policy, an adapter that cannot be served, or token types that are
                not one per prompt token within the model's ``type_vocab_size`` (or given to a decoder).
            QueueFullError: the waiting queue is full.
        """
        keep = getattr(params, "truncate_prompt_tokens", None)   # (a PoolingParams' too)
        pooling = self._pooling_request(params)
        if pooling is not None:   # the prompt's prefill; the one token sampled after it is dropped
            params = _POOLING_STEP   # (no one changes a request's parameters: one object serves every request)
        else:
            params = params or self.default_sampling_params()
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
            params.recheck()   # values set after construction are checked too
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        self._check_awake()
        if not isinstance(request_id, str):
            raise RequestRejectedError(f"a request id must be a string, got {type(request_id).__name__}",
                                       param="request_id")
        old = self._groups.get(request_id)
        if old is not None and not old.aborted:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        # (an aborted request of this id whose end the next step reports gives its sample ids up with the id)
        taken = next((f"{request_id}#{i}" for i in range(params.n)
                      if self._seq_to_group.get(f"{request_id}#{i}", old) is not old), None) if params.n > 1 else None
        if taken is not None:
            raise RequestRejectedError(f"request id {request_id!r} with n={params.n} names its samples "
                                       f"{request_id}#0 .. #{params.n - 1}, and {taken!r} is already in use")
        owner = self._seq_to_group.get(request_id)
        if params.n == 1 and owner is not None and owner is not old:
            raise RequestRejectedError(f"request id {request_id!r} is in use by a sample of request "
                                       f"{owner.request_id!r}")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise RequestRejectedError(f"priority must be an integer, got {priority!r}", param="priority")
        priority = int(priority)
        if priority and self.scheduler.config.scheduling_policy != "priority":
            raise RequestRejectedError("priority needs the priority scheduling policy (--scheduling-policy "
                                       "priority)", param="priority")
        salt_problem = cache_salt_problem(cache_salt)
        if salt_problem is not None:
            raise RequestRejectedError(f"cache_salt {salt_problem}", param="cache_salt")
        embeds = None   # a prompt given as embeddings: [positions, hidden] (plinth.core.prompt_embeds)
        if isinstance(prompt, PromptEmbeds):
            embeds = self._prompt_embeds(prompt, params, pooling, multi_modal_data)
            text, ids = None, [PLACEHOLDER_ID] * len(embeds)
        elif isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenize(prompt)
            bad = self._out_of_vocab(ids)
            if bad is not None:   # a tokenizer with tokens the model's embedding was never resized for
                raise RequestRejectedError(
                    f"the tokenizer gave token id {bad} ({self.tokenizer.convert_ids_to_tokens(bad)!r}) for this text, "
                    f"outside the model's vocabulary [0, {self.vocab_size}): the tokenizer has tokens the model "
                    "does not")
        else:
            text, ids = None, _token_ids(prompt)
            self._check_vocab(ids, None)
        images: list[Any] = []
        rope_layout = None
        if multi_modal_data is not None:
            if self.images is None:
                raise RequestRejectedError("this model takes no image inputs (multi_modal_data): serve an "
                                           "image-and-text model (LLaVA, Qwen2-VL)",
                                           param="multi_modal_data")
            if pooling is not None:
                raise RequestRejectedError("image inputs are for text generation, not embeddings or classification",
                                           param="multi_modal_data")
            if keep is not None:
                raise RequestRejectedError("truncate_prompt_tokens cannot cut a prompt with image inputs",
                                           param="truncate_prompt_tokens")
            from plinth.multimodal.images import salted_key

            ids, images = self.images.items(ids, multi_modal_data)
            if cache_salt is not None or self._image_epoch:   # tenants and epochs never share an encoded image
                images = [dataclasses.replace(item, key=salted_key(item.key, cache_salt, self._image_epoch))
                          for item in images]
            rope_layout = self.images.rope_layout(images)
        elif self.images is not None and self.images.token_id in ids:
            raise RequestRejectedError(f"the prompt has the image token (id {self.images.token_id}) but no image: "
                                       "give the images in multi_modal_data", param="multi_modal_data")
        elif self.images is not None and self.images.video_token_id is not None \
                and self.images.video_token_id in ids:
            raise RequestRejectedError(f"the prompt has the video token (id {self.images.video_token_id}) but no "
                                       "video: give the videos in multi_modal_data", param="multi_modal_data")
        types = self._token_types(token_type_ids, ids) if token_type_ids is not None else None
        if keep is not None:   # the prompt's last tokens only (vLLM's truncate_prompt_tokens)
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise RequestRejectedError(f"truncate_prompt_tokens is {keep}, more than max_model_len "
                                           f"({self.max_model_len}); give a smaller value (or -1: the context)",
                                           param="truncate_prompt_tokens")
            if len(ids) > keep:   # (an encoder's first tokens: see kept_tokens)
                if types is not None:   # the same positions
                    types = kept_tokens(types, keep, self.encoder, closing=ids[-1] in self.special_ids)
                text, ids = None, kept_tokens(ids, keep, self.encoder, self.special_ids)
        if embeds is not None:
            from plinth.core.prompt_embeds import embeds_items
            from plinth.multimodal.images import salted_key

            # (the rows kept by truncate_prompt_tokens)
            images = embeds_items(embeds[len(embeds) - len(ids):], self.scheduler.block_manager.block_size,
                                  multimodal_rope=self.images is not None and self.images.qwen)
            if cache_salt is not None or self._image_epoch:   # tenants and epochs never share cached blocks
                images = [dataclasses.replace(item, key=salted_key(item.key, cache_salt, self._image_epoch))
                          for item in images]
        if not ids:
            raise RequestRejectedError("the prompt is empty")
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        for name in ("logprobs", "prompt_logprobs"):
            asked = whole.get(name, getattr(params, name))
            if asked is not None and asked > self.max_logprobs:
                raise RequestRejectedError(f"{name}: at most {self.max_logprobs} per position (the engine's "
                                           f"max_logprobs, --max-logprobs), got {getattr(params, name)}"
                                           + (f" (the whole vocabulary: {asked})" if name in whole else ""),
                                           param=name)
        if whole:   # -1: every token of the vocabulary (the caller's params stay as given)
            params = params.clone(**whole)
        self._check_vocab(params.logit_bias or (), "logit_bias")
        self._check_vocab(params.allowed_token_ids or (), "allowed_token_ids")
        # stop_token_ids outside the vocabulary are taken, as in vLLM: they never match
        cap, places = self.scheduler.config.max_waiting_requests, self.scheduler.config.max_num_seqs
        if cap is not None and params.n > cap + places:   # more than an idle engine takes at once, ever
            raise RequestRejectedError(f"n is {params.n}, more sequences than the running batch and the waiting queue "
                                       f"hold together ({places} + {cap})", param="n")
        if len(ids) < self.max_model_len and params.min_tokens > self.max_model_len - len(ids):
            raise RequestRejectedError(
                f"min_tokens is {params.min_tokens}, but after the prompt's {len(ids)} tokens this model's context "
                f"of {self.max_model_len} tokens leaves room for {max(self.max_model_len - len(ids), 0)}")
        applies: tuple[bool, ...] = ()   # which custom logits processors apply (they read every token so far)
        if self.logits_processors and pooling is None:
            try:
                applies = check_request(self.logits_processors, params)
            except ValueError as exc:
                raise RequestRejectedError(str(exc), param="extra_args") from None
        custom = any(applies)
        if custom and self.runner is None and params.extra_args:   # the rows travel to worker processes
            try:
                pickle.dumps(params.extra_args)
            except Exception as exc:
                raise RequestRejectedError(f"extra_args must be picklable, as the engine's worker processes run "
                                           f"the logits processors: {type(exc).__name__}: {exc}",
                                           param="extra_args") from None
        bad_words = self._bad_words_ids(params.bad_words) if params.bad_words else []
        if params.allowed_token_ids:
            self._check_some_token_allowed(params, bad_words)
        adapter = self.add_lora(lora_request) if lora_request is not None else None
        matcher = self._matcher(params) if params.structured_outputs is not None else None   # after the cheap checks
        if matcher is not None and (params.allowed_token_ids or any(len(w) == 1 for w in bad_words)):
            self._check_grammar_start(matcher, params, bad_words)
        seqs: list[_Sequence] = []
        run_ids = (self.classifier.read_tokens(ids) if self.classifier is not None and pooling is not None
                   and pooling.task == "classify" else ids)
        group = _Group(request_id, text, ids if embeds is None else [], params, seqs,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                       lora_request=lora_request, num_prompt_embeds=0 if embeds is None else len(ids))
        try:
            for i in range(params.n):
                child_params = params if i == 0 or params.seed is None else params.clone(seed=_child_seed(params.seed, i))
                seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
                req = Request(seq_id, run_ids, child_params, eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                              default_max_tokens=self.default_max_tokens)
                req.priority = priority
                req.bad_words_ids = bad_words
                req.logits_processors = applies if custom else ()
                req.lora = adapter
                req.cache_salt = cache_salt
                req.images = images
                req.prompt_is_embeds = embeds is not None
                req.rope_layout = rope_layout
                if pooling is not None:
                    kind = "all" if pooling.task in _TOKEN_TASKS else self.pooling.kind   # type: ignore[union-attr]
                    # (a token classifier keeps each position's logits as it comes, not its hidden state)
                    reduce = self.classifier.logits_of if self.classifier is not None and kind == "all" else None
                    req.pooling = PoolState(kind, len(run_ids), pooling, reduce)
                if types is not None and any(types):
                    req.token_types = np.asarray(types[:len(run_ids)], dtype=np.int64)
                if matcher is not None:
                    req.matcher = matcher if i == 0 else matcher.deep_copy()
                detok = (IncrementalDetokenizer(self.tokenizer, ids if embeds is None else [], child_params)
                         if self.tokenizer is not None and child_params.detokenize else None)
                seq = _Sequence(req, detok, [] if params.logprobs is not None else None,
                                0.0 if params.logprobs is not None else None)
                seqs.append(seq)
                self._seqs[seq_id] = seq
                self._seq_to_group[seq_id] = group
                self.scheduler.add_request(req)   # last: a sequence the scheduler holds is always known here
        except BaseException:   # a refusal, or an interrupt (KeyboardInterrupt, a signal handler) mid-way
            self.scheduler.abort([s.request.request_id for s in seqs])
            self._drop_seqs(seqs, group)
            raise
        if old is not None:   # aborted, its end not reported yet: the next step reports it first
            self._aborted = [g for g in self._aborted if g is not old]
            self._superseded.append(old)
            self._forget(old)
        self._groups[request_id] = group
        if params.prompt_logprobs is not None:
            self._prompt_logprob_groups.add(request_id)
        if (_needs_sync_steps(params) or custom
                or (pooling is not None and not self.executor.supports_async_pooling)):   # (reads hidden states)
            self._sync_groups.add(request_id)

    def _prompt_embeds(self, prompt: PromptEmbeds, params: SamplingParams, pooling: Any,
                       multi_modal_data: Any) -> torch.Tensor:
        """A prompt given as embeddings, checked: ``[positions, hidden_size]`` in the model's dtype, on the CPU.

        Raises:
            RequestRejectedError: an engine started without ``enable_prompt_embeds``, an embedding or classification
                request, images beside it, ``prompt_logprobs`` (there are no prompt tokens to score), or embeddings
                of another shape or with values that are not finite.
        """
        if not self.prompt_embeds:
            raise RequestRejectedError("prompts given as embeddings need an engine started with enable_prompt_embeds "
                                       "(--enable-prompt-embeds)", param="prompt_embeds")
        if pooling is not None:
            raise RequestRejectedError("prompts given as embeddings are for text generation, not embeddings or "
                                       "classification", param="prompt_embeds")
        if multi_modal_data is not None:
            raise RequestRejectedError("a prompt given as embeddings takes no multi_modal_data (give the images' "
                                       "embeddings among its rows)", param="multi_modal_data")
        if params.prompt_logprobs is not None:
            raise RequestRejectedError("prompt_logprobs needs prompt tokens; a prompt given as embeddings has none",
                                       param="prompt_logprobs")
        from plinth.core.prompt_embeds import checked_embeds

        return checked_embeds(prompt.embeds, self.hidden_size, self.dtype)

    def _token_types(self, token_type_ids: Any, ids: list[int]) -> list[int]:
        """A request's ``token_type_ids``, checked: one per prompt token, each below the model's ``type_vocab_size``.

        Raises:
            RequestRejectedError: naming ``token_type_ids``.
        """
        if not self.num_token_types:
            raise RequestRejectedError("token_type_ids are for encoder models (BERT-style), which read text pairs as "
                                       "two segments; this model has no token types", param="token_type_ids")
        try:
            types = None if isinstance(token_type_ids, dict | set | frozenset | str) else _token_ids(token_type_ids)
        except RequestRejectedError:
            types = None
        if types is None:
            raise RequestRejectedError("token_type_ids must be a list of integers", param="token_type_ids")
        if len(types) != len(ids):
            raise RequestRejectedError(f"token_type_ids holds {len(types)} values for a prompt of {len(ids)} tokens: "
                                       "give one per token", param="token_type_ids")
        if types and (min(types) < 0 or max(types) >= self.num_token_types):
            raise RequestRejectedError(f"token_type_ids must be in [0, {self.num_token_types}) (this model's "
                                       f"type_vocab_size), got {min(types) if min(types) < 0 else max(types)}",
                                       param="token_type_ids")
        return types

    def _pooling_request(self, params: Any) -> PoolingParams | None:
        """The pooling options of a request to an embedding or classification engine (``None`` for a generation
        request).

        Raises:
            RequestRejectedError: PoolingParams on a generation engine, SamplingParams on an embedding engine,
                more ``dimensions`` than the model's hidden size, or an option of the other pooling task.
        """
        if self.task == "generate":
            if isinstance(params, PoolingParams):
                raise RequestRejectedError("embeddings need an engine started with task='embed' (--task embed), "
                                           "classification one with task='classify'")
            return None
        per_token = self.classifier is not None and self.classifier.per_token
        what = ("an embedding model" if self.task == "embed" else "a token classifier" if per_token
                else "a sequence classifier")
        if params is not None and not isinstance(params, PoolingParams):
            raise RequestRejectedError(f"this engine serves {what} (task={self.task!r}): it takes "
                                       "PoolingParams, not sampling parameters")
        pooling = params or PoolingParams()
        tasks = (("token_classify",) if per_token
                 else ("classify",) if self.task == "classify" and self.encoder   # (its head reads the first token)
                 else ("classify", "token_classify") if self.task == "classify" else ("embed", "token_embed"))
        if pooling.task is None:
            pooling = dataclasses.replace(pooling, task=tasks[0])
        elif pooling.task not in tasks:
            # (the hint names what serves the task: a token classifier's own task; a sequence classifier)
            hint = {"classify": ": use the token_classify task (LLM.encode, /pooling)" if per_token
                    else ": sequence classifiers (*ForSequenceClassification, --task classify) serve it",
                    "token_classify": ": token classifiers (*ForTokenClassification) and decoders' sequence "
                                      "classifiers serve it"}
            raise RequestRejectedError(f"the {pooling.task} task is not one of {what}'s ({', '.join(tasks)})"
                                       + hint.get(pooling.task, ""), param="task")
        if self.task == "classify":
            wrong = next((f for f in ("dimensions", "normalize") if getattr(pooling, f) is not None), None)
            if wrong is not None:
                raise RequestRejectedError(f"{wrong} applies to embeddings, not to {what}'s probabilities",
                                           param=wrong)
        if pooling.dimensions is not None and self.hidden_size and pooling.dimensions > self.hidden_size:
            raise RequestRejectedError(f"dimensions is {pooling.dimensions}, but this model's embeddings have "
                                       f"{self.hidden_size}", param="dimensions")
        return pooling

    def _check_some_token_allowed(self, params: SamplingParams, bad_words: list[list[int]]) -> None:
        """Refuse ``allowed_token_ids`` that the request's other masks ban outright (one-token ``bad_words``,
        and while ``min_tokens`` lasts the EOS and stop ids): no token could be drawn.

        Raises:
            RequestRejectedError: naming ``allowed_token_ids``.
        """
        allowed = set(params.allowed_token_ids or ())
        banned = {w[0] for w in bad_words if len(w) == 1}
        if not allowed - banned:
            raise RequestRejectedError("allowed_token_ids: every allowed token is banned by bad_words",
                                       param="allowed_token_ids")
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.min_tokens and not allowed - banned - ends:
            raise RequestRejectedError("allowed_token_ids: every allowed token ends the sequence, which min_tokens "
                                       "forbids for its first tokens", param="allowed_token_ids")

    def _check_grammar_start(self, matcher: Any, params: SamplingParams, bad_words: list[list[int]]) -> None:
        """Refuse ``allowed_token_ids`` / one-token ``bad_words`` that leave the structured output no first token.

        Raises:
            RequestRejectedError: naming ``allowed_token_ids`` (or ``bad_words`` without it).
        """
        first = allowed_tokens([matcher], self.vocab_size)[0]   # [V] bool: what the constraint accepts first
        if params.allowed_token_ids:
            keep = np.zeros(self.vocab_size, dtype=bool)
            keep[list(params.allowed_token_ids)] = True
            first &= keep
        first[[w[0] for w in bad_words if len(w) == 1]] = False
        if not first.any():
            param = "allowed_token_ids" if params.allowed_token_ids else "bad_words"
            raise RequestRejectedError(f"{param}: no token the structured output accepts first is left by "
                                       f"{' and '.join(p for p in ('allowed_token_ids', 'bad_words') if getattr(params, p))}",
                                       param=param)

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """``bad_words`` as token sequences: each word alone and after a space (how it appears mid-text),
        as vLLM forms them."""
        if self.tokenizer is None:
            raise RequestRejectedError("bad_words needs the model's tokenizer", param="bad_words")
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            if not encodable_text(word):
                raise RequestRejectedError("bad_words: a word is not valid Unicode text (a lone surrogate?)",
                                           param="bad_words")
            for form in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(form, add_special_tokens=False))
                if ids and all(0 <= t < self.vocab_size for t in ids):
                    seqs[ids] = None
        return [list(s) for s in seqs]

    def _out_of_vocab(self, ids: Any) -> int | None:
        """The first of ``ids`` outside the vocabulary, if any."""
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return None
        return next((t for t in ids if not 0 <= t < self.vocab_size), None)

    def _check_vocab(self, ids: Any, param: str | None) -> None:
        """Refuse token ids outside the vocabulary (``param``: the field they came from; None: the prompt)."""
        bad = self._out_of_vocab(ids)
        if bad is not None:
            raise RequestRejectedError(f"{param + ': ' if param else ''}token id {bad} is out of range "
                                       f"[0, {self.vocab_size})", param=param)

    def default_sampling_params(self) -> SamplingParams:
        """The parameters of a request that sets none: plinth's defaults with the model's generation config
        on top (:mod:`plinth.model_registry.generation_config`); with its ``max_new_tokens``, ``max_tokens``
        is ``None``: the request stops there or where the context ends, whichever comes first."""
        if self.default_max_tokens is not None:
            return SamplingParams(**self.default_sampling, max_tokens=None)
        return SamplingParams(**self.default_sampling)

    def grammar_matcher(self, spec: dict[str, Any]) -> Any:
        """A matcher for the structured-output ``spec`` (thread-safe; the server calls it from a worker
        thread first, so that the request's own call on the engine's thread copies a prepared one).

        Raises:
            StructuredOutputError: the constraint does not compile, or the model has no tokenizer.
        """
        if self.tokenizer is None:
            raise StructuredOutputError("this model has no tokenizer")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars.matcher(spec)

    def _reasoning_markers(self, parser: Any) -> ReasoningMarkers | None:
        """The thinking markers of the ``reasoning_parser`` class as tokens (constraints start after them)."""
        if parser is None:
            return None
        name = parser.name
        markers = (reasoning_markers(self.tokenizer, parser.START, parser.END, parser.starts_in_thinking)
                   if self.tokenizer is not None else None)
        if markers is None:
            logger.warning("reasoning parser %s: %r and %r are not single tokens of this model's tokenizer, so "
                           "structured-output constraints apply to the whole reply, thinking included", name,
                           parser.START, parser.END)
        return markers

    def _matcher(self, params: SamplingParams) -> Any:
        """A grammar matcher for ``params.structured_outputs``; a constraint that cannot compile is a
        :class:`RequestRejectedError` naming ``structured_outputs``."""
        assert params.structured_outputs is not None
        try:
            matcher = self.grammar_matcher(params.structured_outputs)
            if self._reasoning is not None:
                return AfterReasoning(matcher, self._reasoning, self.vocab_size, self.eos_token_ids)
            return matcher
        except StructuredOutputError as exc:
            raise RequestRejectedError(f"{STRUCTURED_PARAM}: {exc}", param=STRUCTURED_PARAM) from None

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests at once (their KV blocks are freed); the next step reports them finished."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif not isinstance(request_ids, Iterable) or isinstance(request_ids, bytes):
            raise TypeError(f"request_ids must be a request id or a list of them, got {request_ids!r}")
        for rid in request_ids:
            group = self._groups.get(rid)
            if group is None or group.aborted:
                continue
            self._abort_group(group)
            self._aborted.append(group)

    def _abort_group(self, group: _Group) -> None:
        """Stop a request's sequences (their KV blocks are freed) and mark it aborted."""
        self.scheduler.abort([s.request.request_id for s in group.seqs])
        for s in group.seqs:   # the text held back (a stop string's possible start) is returned, as at any end
            if s.detok is not None:
                s.detok.flush()
        group.aborted = True

    def aborted_pending(self, request_id: str) -> bool:
        """Whether ``request_id`` names an aborted request whose end the next step reports (a new request may take
        the id now: that end is reported first)."""
        group = self._groups.get(request_id)
        return group is not None and group.aborted

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache: no later request reuses KV blocks computed before this call (after new weights,
        say, or between benchmark runs). Blocks that running requests hold stay cached while they run; returns
        ``False`` where there were any (call it with no request running to forget everything), ``True`` otherwise.
        A no-op returning ``True`` without prefix caching."""
        dropped, held = self.block_manager.reset_prefix_cache()
        self._image_epoch += 1   # no later request finds images encoded before either (their keys change)
        logger.info("prefix cache reset: %d cached block(s) forgotten%s", dropped,
                    f", {held} kept (held by running requests)" if held else "")
        return held == 0

    def update_weights(self, weights: Any, reset_prefix_cache: bool = True) -> int:
        """Load new values into the model's weights in place, on every rank (reinforcement learning: the trained
        copy's weights handed over between rounds of generation); the number of tensors loaded.

        ``weights``: checkpoint (Hugging Face) names of the architecture's causal-LM checkpoint and tensors, any
        subset of them: a mapping (a ``state_dict()``), ``(name, tensor)`` pairs, or the path of a safetensors
        file or checkpoint directory. Values are cast to the model's dtype; each rank takes its own shard.
        Requests running at the time go on with the new weights from their next step. ``reset_prefix_cache``
        (default): no later request reuses KV blocks computed with the old weights (also those running requests
        hold, see :meth:`reset_prefix_cache`).

        Raises:
            ModelLoadError: a quantized model, a classifier, or the CPU path's repacked weights
                (``PLINTH_CPU_PACKED=0`` keeps the plain ones), which cannot take new values in place; a name with
                no parameter, a non-float tensor or a shape that does not fit (checked on every rank before any
                writes, except by a model's own loaders: see :func:`plinth.model_registry.weight_update.update_weights`).
            EngineDeadError: the engine is dead.
        """
        import os

        from plinth.errors import ModelLoadError
        from plinth.model_registry.weight_update import weight_pairs

        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if self.classifier is not None:
            raise ModelLoadError("cannot update the weights in place: a classifier's label weights are read into "
                                 "the engine at load time; load the new weights with a new engine")
        self._check_weights_awake()
        t0 = time.perf_counter()
        if isinstance(weights, str | os.PathLike):
            pairs = self.checkpoint_weights(weights)
        else:
            pairs = weight_pairs(weights)
            if self.model_source.text_only:   # an image-and-text model's state dict: its language model's names
                from plinth.model_registry.loader import language_model_names

                pairs = language_model_names(pairs)
        try:
            count = self.executor.update_weights(pairs)
            self._weights_discarded = False
        finally:   # (also after a failed write, which may have written some tensors)
            if reset_prefix_cache:
                self.block_manager.new_epoch()   # blocks running requests hold are unreachable too
                self.reset_prefix_cache()
        logger.info("weights updated: %d tensor(s) in %.2f s", count, time.perf_counter() - t0)
        return count

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """``fn(model)`` on the model of every rank, between steps (vLLM's ``apply_model``); the results in rank order
        (one for an in-process engine). The model is plinth's module (fused projections such as ``qkv_proj`` and
        ``gate_up_proj``; on each tensor-parallel rank its shard, on each pipeline stage its layers). For worker
        processes ``fn`` must pickle (a module-level function, or a ``functools.partial`` of one) and so must its
        results (plain values, CPU tensors). A function that changes weights should change them in place (decode
        graphs hold their addresses) and be followed by :meth:`reset_prefix_cache`.

        Raises:
            EngineSleepingError: the weights sleep.
            TypeError: ``fn`` or a result cannot cross to or from worker processes.
            whatever ``fn`` raises (from a worker process: the same type where it pickles).
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        self._check_weights_awake()
        return self.executor.apply_model(fn)

    def sleep(self, level: int = 1) -> None:
        """Give the KV cache's memory back, and on an accelerator the weights' (an engine started with
        ``enable_sleep_mode``; vLLM's sleep mode): level 1 copies the weights to host memory, level 2 discards
        them (the trainer's next :meth:`update_weights` brings them, after ``wake_up(tags=["weights"])``). The KV
        cache's contents, and so the prefix cache, are lost at either level. On a CPU the weights stay where they
        are (host memory) and only level 1 is taken. Requests are refused while any part sleeps.

        Raises:
            SleepModeError: sleep mode is off, requests are unfinished, the engine is asleep already, a bad level,
                or level 2 where the weights cannot be loaded again in place (quantized, a CPU).
        """
        self._check_sleep_mode("sleep")
        if isinstance(level, bool) or level not in (1, 2):
            raise SleepModeError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights discarded), "
                                 f"got {level!r}")
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if self._asleep:
            raise SleepModeError("the engine is asleep already: wake_up() first")
        live = sum(not g.aborted for g in self._groups.values())   # (aborted ones hold no blocks)
        if live:
            raise SleepModeError(f"cannot sleep with {live} unfinished request(s): let them finish or abort them "
                                 "first")
        if level == 2:   # (each rank's runner refuses weights that update_weights() cannot take: quantized ...)
            if self.device.type == "cpu":
                raise SleepModeError("sleep level 2 discards the weights to free accelerator memory; on a CPU they "
                                     "are in host memory already: sleep(level=1) frees the KV cache")
            if self.classifier is not None:
                raise SleepModeError("sleep level 2 discards weights that update_weights() could not bring back: a "
                                     "classifier's label weights are read into the engine at load time; "
                                     "sleep(level=1) keeps them")
        t0 = time.perf_counter()
        freed = self.executor.sleep(level)
        if self.draft is not None:   # level 1 for the draft model: update_weights() does not reach it
            freed += self.draft.runner.sleep(1)
            self.draft.forget()
        self._asleep = set(SLEEP_TAGS)
        self._weights_discarded = self._weights_discarded or level == 2   # (until update_weights brings them)
        self.block_manager.new_epoch()   # the cached blocks' contents are gone
        self.reset_prefix_cache()
        logger.info("asleep (level %d): %.2f GiB of %s memory freed in %.2f s", level, freed / 2**30,
                    self.device.type, time.perf_counter() - t0)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory of ``tags`` again (default: all; ``"weights"``, ``"kv_cache"``: vLLM's tags; waking the
        weights first lets :meth:`update_weights` load them before the KV cache takes its memory). A no-op for
        parts awake already.

        Raises:
            SleepModeError: sleep mode is off, or an unknown tag.
            ConfigError: no room on the device for them now (they stay asleep; wake up again later).
        """
        self._check_sleep_mode("wake_up")
        tags = SLEEP_TAGS if tags is None else ((tags,) if isinstance(tags, str) else tuple(tags))
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad or not tags:
            raise SleepModeError(f"wake_up tags must be among {', '.join(SLEEP_TAGS)}, got {list(tags)!r}")
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        waking = [t for t in SLEEP_TAGS if t in tags and t in self._asleep]
        if not waking:
            return
        t0 = time.perf_counter()
        for tag in waking:   # one part at a time: a part that fails to wake leaves the others' state right
            self.executor.wake_up([tag])
            if self.draft is not None:
                self.draft.runner.wake_up([tag])
            self._asleep.discard(tag)
        logger.info("awake: %s in %.2f s%s", " and ".join(waking), time.perf_counter() - t0,
                    "" if not self._asleep else f" ({' and '.join(sorted(self._asleep))} asleep still)")

    def is_sleeping(self) -> bool:
        """Whether any part of the engine sleeps (see :meth:`sleep`)."""
        return bool(self._asleep)

    def _check_sleep_mode(self, what: str) -> None:
        if not self.config.device.enable_sleep_mode:
            raise SleepModeError(f"{what}() needs an engine started with enable_sleep_mode=True "
                                 "(--enable-sleep-mode)")

    def _check_weights_awake(self) -> None:
        if "weights" in self._asleep:
            raise EngineSleepingError("the weights are asleep: wake_up(tags=['weights']) first (the KV cache may sleep "
                                      "on while they are used)")

    def _check_awake(self) -> None:
        if self._asleep:
            raise EngineSleepingError("the engine is asleep: wake_up() first")
        if self._weights_discarded:
            raise EngineSleepingError("the weights were discarded by sleep(level=2): load them with update_weights() "
                                 "first")

    def checkpoint_weights(self, path: Any) -> list[tuple[str, Any]]:
        """The tensors of a safetensors file or checkpoint folder of this engine's model layout, named as the model
        takes them (renamed as at load time: a base model's prefix, an image-and-text checkpoint's language model).

        Raises:
            ModelLoadError: not a safetensors checkpoint, unreadable, or a layout whose tensors cannot be loaded as
                they are (a bitsandbytes checkpoint's quantized tensors).
        """
        from plinth.model_registry.loader import update_stream
        from plinth.model_registry.weight_update import weight_pairs

        rename = update_stream(self.model_source)
        pairs = weight_pairs(path)
        if rename is None:
            return pairs
        out = list(rename(pairs))
        if self.images is not None:   # the vision tower's and projector's tensors go to the image encoder
            from plinth.multimodal.vision import ENCODER_PREFIXES

            out += [(n, t) for n, t in pairs if n.startswith(ENCODER_PREFIXES)]
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups or self._superseded)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups) + len(self._superseded)

    def idle_work(self) -> bool:
        """Do a few milliseconds of work that makes later steps faster, for a caller with no request to run
        (the server's engine loop between requests): on the CPU, fault the next chunk of the KV cache's
        memory in. Returns whether any is left; ``False`` at once while requests run."""
        if self._groups or self._dead is not None:
            return False
        return self.executor.idle_work()

    # ----------------------------------------------------------------------------------- stepping

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; return the requests that progressed or finished in it.

        Args:
            final_only: report only requests that finished (offline use: skips building an
                output per running request per step).
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        touched: dict[str, _Group] = {g.request_id: g for g in self._aborted}
        self._aborted.clear()
        superseded, self._superseded = self._superseded, []
        try:
            self._schedule_and_run(touched, final_only)
        except BaseException:
            # the requests this step was to report (aborted, or finished by the step before) go to the next one
            kept = {id(g) for g in self._aborted}
            self._aborted.extend(g for g in touched.values() if id(g) not in kept and g.request_id in self._groups
                                 and (g.aborted or g.finished))
            self._superseded[:0] = superseded
            raise
        # aborted requests whose id a new request took before this step: their ends first
        outputs = [self._make_output(g) for g in superseded]
        for g in touched.values():
            if final_only and not g.finished:
                continue
            output = self._make_output(g)
            if output.finished:
                self._forget(g)
            outputs.append(output)
        if self._in_flight is not None and not self._groups:
            # only the dropped tokens of stopped requests are left in it: read it back now, and let a
            # failure surface on the next step rather than lose this step's outputs
            try:
                self._finish_in_flight({}, final_only)
            except Exception:
                logger.exception("reading back the last step in flight failed")
        return outputs

    def _schedule_and_run(self, touched: dict[str, _Group], final_only: bool) -> None:
        """One step's scheduling and execution (asynchronous or not), noting the groups to report in ``touched``."""
        if self.async_scheduling and not self._sync_groups:
            self._step_async(touched, final_only)
        else:
            if self._in_flight is not None:   # drain: the next step needs the host to know every token
                self._finish_in_flight(touched, final_only)
            out = self.scheduler.schedule()
            if out.scheduled:
                try:
                    self._execute(out, touched, final_only)
                except BaseException:
                    # its tokens are lost (an error, an interrupt): its requests end rather than stay stuck
                    # with computed tokens that were never written
                    self._abort_after_failure([out])
                    raise
            else:
                self._batch_builder.release(out)

    def _make_sampling_batch(self, reqs: list[Request]) -> Callable[[torch.device], Any] | None:
        sampling = self._sampling
        # built by the executor where it samples, after the forward pass is queued
        return (lambda device: sampling.build(reqs, device)) if reqs else None

    def _execute(self, out: SchedulerOutput, touched: dict[str, _Group], final_only: bool) -> None:
        """Run the scheduled batch, apply its tokens, and note in ``touched`` the groups to report:
        with ``final_only`` only those that may have finished, else every one that progressed."""
        started = time.perf_counter()
        batch, reqs = self._batch_builder.build(out)
        result, hidden = self._run_guarded(self.executor.execute, batch, self._make_sampling_batch(reqs))
        extra = 0.0   # prompt logprobs cost per prompt token far more than a prefill: not a step's usual cost
        if hidden is not None and self._prompt_logprob_groups:
            t = time.perf_counter()
            self._prompt_logprobs(out, hidden)
            extra = time.perf_counter() - t
        if hidden is not None and self.pooling is not None:
            self._pool(out, hidden)
        if result is None:
            self.scheduler.update_from_output(out, [None] * len(out.scheduled))
            return
        token_ids = result.sampled_token_ids.tolist()   # the step's one host-device sync
        if self.step_cost is not None:
            self.step_cost.observe(out.num_scheduled_tokens - out.num_decodes, out.num_decodes,
                                   time.perf_counter() - started - extra)
        positions = None
        if result.logprobs is not None:
            positions = result.logprobs.to_position_logprobs([r.sampling_params.logprobs for r in reqs])
        if result.failed:   # first: their tokens (drawn without the processor) are dropped with them
            self._fail_rows(reqs, result.failed, touched)
        if len(reqs) > len(out.sampled):   # speculative rows
            self._apply_verified(out, reqs, token_ids, positions, touched, final_only)
        else:
            if positions is not None:
                self._record_logprobs(reqs, positions, token_ids)
            self._apply_tokens(out, reqs, token_ids, touched, final_only)

    def _fail_rows(self, rows: list[Any], failed: dict[int, str], touched: dict[str, _Group]) -> None:
        """End the requests of ``rows`` whose custom logits processor failed (``failed``: row -> what failed)
        with that error, before the step's tokens are applied (theirs are dropped); this step reports them."""
        for row, message in failed.items():
            rid = rows[row].request_id
            group = self._seq_to_group.get(rid)
            seq = self._seqs.get(rid)
            if group is None or group.error is not None or seq is None or seq.request is not rows[row]:
                continue   # (a row of an aborted request whose id a new request took)
            group.error = message
            if not group.finished:
                self._abort_group(group)
            touched[group.request_id] = group

    def _apply_verified(self, out: SchedulerOutput, rows: list[Any], samples: list[int],
                        positions: list[PositionLogprobs | None] | None, touched: dict[str, _Group],
                        final_only: bool) -> None:
        """Apply a step with draft tokens: ``samples`` (and ``positions``, the logprobs) hold one entry per
        sampled position (``rows``); each sequence takes the samples that verify its drafts
        (:func:`~plinth.core.speculative.accepted_tokens`), which go through the usual stop conditions one by
        one; a stop string inside them ends the output where it ends."""
        per_entry: list[int | list[int] | None] = []
        kept: list[tuple[Request, list[int], list[PositionLogprobs | None]]] = []
        stats = self.speculative
        at = 0
        for s in out.scheduled:
            if not s.sample:
                per_entry.append(None)
                continue
            n = 1 + s.num_drafts
            tokens = samples[at:at + n]
            if s.num_drafts:
                tokens = accepted_tokens(s.request.draft_token_ids, tokens)
                if stats is not None:
                    stats.num_drafts += 1
                    stats.num_draft_tokens += s.num_drafts
            kept.append((s.request, tokens, positions[at:at + len(tokens)] if positions is not None else []))
            per_entry.append(tokens if s.num_drafts else tokens[0])
            at += n
        assert at == len(rows)
        before = {r.request_id: r.num_output_tokens for r, _, _ in kept}
        drafted = {s.request.request_id for s in out.scheduled if s.num_drafts}
        for req, tokens, pos in kept:
            if pos:
                self._record_logprobs([req] * len(tokens), pos, tokens)
        finished = {r.request_id for r in self.scheduler.update_from_output(out, per_entry)}
        seqs, groups = self._seqs, self._seq_to_group
        for req, taken, _ in kept:
            rid = req.request_id
            ended = rid in finished
            if not ended and req.is_finished:
                continue
            seq = seqs[rid]
            new = req.output_token_ids[before[rid]:]   # the tokens the request took (fewer when it stopped)
            by_token = ended and req.finish_reason == FinishReason.STOP   # the scheduler's verdict: its last token
            for i, tok in enumerate(new):
                last = i == len(new) - 1
                if req.matcher is not None and not ended:   # (a request with a grammar carries no drafts)
                    state = self._grammar_state(req, tok)
                    if state is not None:
                        self.scheduler.finish_request(rid, state)
                        ended = True
                        if state == FinishReason.ABORT:
                            self._drop_refused_token(seq, req, before[rid] + i)
                            break
                elif req.matcher is not None and last and req.finish_reason == FinishReason.LENGTH:
                    self._complete_at_the_limit(req, tok)
                if seq.detok is None:
                    continue
                _, stop_str = seq.detok.add_tokens([tok], finished=ended and last, stopped_by_token=by_token and last)
                if stop_str is None:
                    continue
                if not ended:
                    self.scheduler.finish_request(rid, FinishReason.STOP, stop_str)
                    ended = True
                elif not last or req.finish_reason == FinishReason.LENGTH:
                    # it ended at a later token, or at this one by length: the stop string comes first
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
                elif req.finish_reason == FinishReason.STOP:
                    # the grammar's end or the stop token came with a stop string (in text its last token flushed)
                    req.stop_reason = stop_str
                if not last:
                    req.truncate_output(before[rid] + i + 1)
                break
            if seq.logprobs is not None and len(seq.logprobs) > req.num_output_tokens:
                self._trim_logprobs(seq, req)
            if stats is not None and rid in drafted:   # the drafts it kept (not those after a stop): all the
                # verified tokens but the last (the sample after them), fewer when a stop came among them
                stats.num_accepted_tokens += min(req.num_output_tokens - before[rid], len(taken) - 1)
            if ended or not final_only:
                group = groups[rid]
                touched[group.request_id] = group

    def _drop_refused_token(self, seq: _Sequence, req: Request, keep: int) -> None:
        """End a sequence whose structured-output matcher refused its newest token (every token the constraint
        allowed was masked by the request's own restrictions, or the matcher hit a limit): the output keeps its
        first ``keep`` tokens (the refused one is neither returned nor counted) and the held-back text is
        flushed."""
        req.truncate_output(keep)
        if seq.detok is not None:
            seq.detok.add_tokens([], finished=True)
        if seq.logprobs is not None and len(seq.logprobs) > req.num_output_tokens:
            self._trim_logprobs(seq, req)

    def _trim_logprobs(self, seq: _Sequence, req: Request) -> None:
        """Keep the logprobs of the tokens the request kept (after a speculative step ended it early)."""
        if seq.logprobs is None:
            return
        del seq.logprobs[req.num_output_tokens:]
        seq.cumulative_logprob = sum(pos[t].logprob for pos, t in zip(seq.logprobs, req.output_token_ids,
                                                                        strict=True)) if seq.logprobs else None

    def _step_async(self, touched: dict[str, _Group], final_only: bool) -> None:
        """Schedule and launch the next step, then read back and apply the step in flight.

        Requests sampled by the step in flight decode their unknown token in the new step: the
        runner takes it from that step's output on the device (a :class:`TokenFeed`), so the
        device never waits for the host between steps."""
        prev, self._in_flight = self._in_flight, None
        out: SchedulerOutput | None = None
        try:
            out = self.scheduler.schedule()
            if out.scheduled:
                batch, reqs = self._batch_builder.build(out, prev.rows if prev is not None else None)
                if batch.feed is not None:
                    assert prev is not None
                    batch.feed.tokens = prev.step.device_tokens
                spans = self._pool_spans(out) if self.pooling is not None else None
                pool = ([(a, b) for _, _, a, b in spans],) if spans else ()   # (the rows embedding requests read)
                step = self._run_guarded(self.executor.launch, batch, self._make_sampling_batch(reqs), *pool)
                for r in reqs:
                    r.num_pending_tokens += 1
                self._in_flight = _InFlight(out, reqs, step, {r.request_id: i for i, r in enumerate(reqs)},
                                            spans or None)
            else:
                self._batch_builder.release(out)
            if prev is not None:
                self._apply_in_flight(prev, touched, final_only)
        except BaseException:
            # The tokens of these steps are lost (and the device may have fed them on): abort their
            # requests rather than let them continue out of step with their KV cache.
            self._abort_after_failure([prev.out if prev is not None else None, out])
            self._in_flight = None
            raise

    def _abort_after_failure(self, outs: list[SchedulerOutput | None]) -> None:
        groups = {self._seq_to_group[s.request.request_id].request_id
                  for o in outs if o is not None for s in o.scheduled
                  if s.request.request_id in self._seq_to_group and not s.request.is_finished}
        for o in outs:
            for s in o.scheduled if o is not None else ():
                s.request.num_pending_tokens = 0
                # blocks registered in the prefix cache for this step's tokens may never have been written
                self.block_manager.uncache_unwritten(s.request, s.num_computed_tokens)
            if o is not None and o.state_saves:   # nor the Mamba states the step was to save
                self.block_manager.drop_state_saves(o.state_saves)
        if groups:
            logger.error("a step failed with requests in flight; aborting %d request(s)", len(groups))
            self.abort_request(sorted(groups))

    def _finish_in_flight(self, touched: dict[str, _Group], final_only: bool) -> None:
        prev, self._in_flight = self._in_flight, None
        if prev is None:
            return
        try:
            self._apply_in_flight(prev, touched, final_only)
        except BaseException:
            self._abort_after_failure([prev.out])
            raise

    def _apply_in_flight(self, prev: _InFlight, touched: dict[str, _Group], final_only: bool) -> None:
        token_ids = self._run_guarded(prev.step.token_ids)   # waits for that step only
        for r in prev.reqs:
            r.num_pending_tokens -= 1
        if prev.pooled:
            self._add_pooled(prev.pooled, self._run_guarded(prev.step.pooled_rows))
        if prev.step.output is None:
            self.scheduler.update_from_output(prev.out, [None] * len(prev.out.scheduled))
            return
        failed = getattr(prev.step.output, "failed", None)   # (processor rows run synchronously: not expected here)
        if failed:
            self._fail_rows(prev.reqs, failed, touched)
        if prev.step.output.logprobs is not None:
            num_logprobs = [r.sampling_params.logprobs for r in prev.reqs]
            positions = prev.step.output.logprobs.to_position_logprobs(num_logprobs)
            self._record_logprobs(prev.reqs, positions, token_ids)
        self._apply_tokens(prev.out, prev.reqs, token_ids, touched, final_only)

    def _apply_tokens(self, out: SchedulerOutput, reqs: list[Request], token_ids: list[int],
                      touched: dict[str, _Group], final_only: bool) -> None:
        sampled = token_ids if len(reqs) == len(out.scheduled) else out.expand_sampled(token_ids)
        finished = self.scheduler.update_from_output(out, sampled)
        now_finished = {r.request_id for r in finished}
        seqs, groups = self._seqs, self._seq_to_group
        stop = FinishReason.STOP
        for req, tok in zip(reqs, token_ids, strict=True):
            rid = req.request_id
            ended = rid in now_finished
            if not ended and req.is_finished:
                continue   # stopped or aborted while this step was in flight: its token is dropped
            by_token = ended and req.finish_reason == stop
            if req.matcher is not None and not ended:
                state = self._grammar_state(req, tok)
                if state is not None:   # complete (nothing but EOS could follow), or the matcher failed
                    self.scheduler.finish_request(rid, state)
                    ended = True
                    if state == FinishReason.ABORT:
                        self._drop_refused_token(seqs[rid], req, req.num_output_tokens - 1)
                        touched[groups[rid].request_id] = groups[rid]
                        continue
            elif req.matcher is not None and req.finish_reason == FinishReason.LENGTH:
                self._complete_at_the_limit(req, tok)
            detok = seqs[rid].detok
            if detok is not None:
                _, stop_str = detok.add_tokens([tok], finished=ended, stopped_by_token=by_token)
                if stop_str is not None and not ended:
                    self.scheduler.finish_request(rid, stop, stop_str)
                    ended = True
                elif stop_str is not None and req.finish_reason == stop:
                    # the grammar's end or the stop token came with a stop string (in text its last token flushed)
                    req.stop_reason = stop_str
                elif stop_str is not None and req.finish_reason == FinishReason.LENGTH:
                    # the last token allowed completed a stop string: the stop string is why it ended
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if ended or not final_only:
                group = groups[rid]
                touched[group.request_id] = group

    @classmethod
    def _complete_at_the_limit(cls, req: Request, token: int) -> None:
        """A constrained sequence ended by its token limit: when its last token completed the constrained text,
        the text ended it (``stop``), not the limit."""
        if cls._grammar_state(req, token) == FinishReason.STOP:
            req.status = RequestStatus.FINISHED_STOPPED

    @staticmethod
    def _grammar_state(req: Request, token: int) -> FinishReason | None:
        """Advance the sequence's matcher by its new token: ``STOP`` when the constrained text is complete,
        ``ABORT`` when the matcher failed (a resource limit: the text may not satisfy the constraint),
        else ``None``."""
        matcher = req.matcher
        if not matcher.consume_token(token) or matcher.is_error():
            logger.warning("request %s: the structured-output matcher failed at token %d (%s); the sequence is "
                           "aborted", req.request_id, token, matcher.get_error())
            return FinishReason.ABORT
        return FinishReason.STOP if matcher.is_stopped() else None

    def _run_guarded(self, fn: Any, *args: Any) -> Any:
        """Call the executor; when its workers are gone, fail every in-flight request and raise."""
        try:
            return fn(*args)
        except EngineDeadError as exc:
            raise self._die(exc) from exc

    def _die(self, exc: EngineDeadError) -> EngineDeadError:
        """Mark the engine dead after a worker failure: every unfinished request gets a final output
        with ``error`` set (attached to the raised error as ``outputs``), the executor is shut down."""
        message = f"the engine's workers failed: {exc}"
        outputs = []
        for group in list(self._groups.values()):
            out = self._make_output(group)
            out.finished, out.error = True, message
            outputs.append(out)
        self._groups.clear()
        self._seqs.clear()
        self._seq_to_group.clear()
        self._prompt_logprob_groups.clear()
        self._sync_groups.clear()
        self._in_flight = None
        self._dead = EngineDeadError(message)
        self._dead.outputs = outputs  # type: ignore[attr-defined]
        self.executor.shutdown()
        logger.error("%s; %d in-flight request(s) failed", message, len(outputs))
        return self._dead

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def shutdown(self) -> None:
        """Stop the executor's workers (bounded time; idempotent). The engine cannot step afterwards."""
        self.executor.shutdown()
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")

    def _forget(self, group: _Group) -> None:
        if self._groups.get(group.request_id) is group:   # (a superseded group: its id is another's now)
            del self._groups[group.request_id]
            self._prompt_logprob_groups.discard(group.request_id)
            self._sync_groups.discard(group.request_id)
        self._drop_seqs(group.seqs, group)

    def _drop_seqs(self, seqs: list[_Sequence], group: _Group) -> None:
        """Forget ``seqs`` of ``group`` (ids that another request's sequences took since are left alone)."""
        for s in seqs:
            rid = s.request.request_id
            if self._seq_to_group.get(rid) is group:
                del self._seq_to_group[rid]
            if self._seqs.get(rid) is s:
                del self._seqs[rid]

    def _record_logprobs(self, reqs: list[Request], positions: list[PositionLogprobs | None],
                         token_ids: list[int]) -> None:
        for j, req in enumerate(reqs):
            seq = self._seqs.get(req.request_id)
            pos = positions[j]
            if seq is None or req.is_finished or seq.logprobs is None or pos is None:
                continue
            seq.logprobs.append(self._decorate(pos))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + pos[token_ids[j]].logprob

    def _decorate(self, pos: PositionLogprobs) -> PositionLogprobs:
        """Each entry's ``decoded_token``: the token's text, as vLLM gives it (``" there"``, not the vocabulary's
        ``"Ġthere"``; a token that is part of a UTF-8 character decodes to U+FFFD)."""
        if self.tokenizer is not None:
            texts = self._token_texts
            for tid, lp in pos.items():
                text = texts.get(tid)
                if text is None:
                    text = texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
                lp.decoded_token = text
        return pos

    @functools.cached_property
    def _token_texts(self) -> dict[int, str]:
        return {}

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        # decodes come first (one row each, more with drafts); they have no prompt logprobs
        row = sum(s.num_new_tokens for s in out.scheduled[:out.num_decodes])
        for s in out.scheduled[out.num_decodes:]:
            n = s.num_new_tokens
            group = self._seq_to_group.get(s.request.request_id)
            if (group is not None and group.prompt_logprobs is not None and not s.is_decode
                    and s.request is group.seqs[0].request):
                start = s.num_computed_tokens
                prompt = group.prompt_token_ids
                # rows predicting prompt tokens start+1 .. min(start+n, len(prompt)-1); a request preempted
                # during its prefill computes its prompt again from the start: positions already recorded
                # (entry i is position i) are skipped
                stop = min(start + n, len(prompt) - 1)
                first = max(start, len(group.prompt_logprobs) - 1)
                if stop > first:
                    logits = self._run_guarded(self.executor.prompt_logits, hidden,
                                               slice(row + first - start, row + stop - start))
                    targets = prompt[first + 1: stop + 1]
                    k = group.params.prompt_logprobs or 0
                    lps = compute_prompt_logprobs(logits, targets, k, self.logprobs_as_logits).to_position_logprobs(
                        [k] * len(targets))
                    group.prompt_logprobs.extend(self._decorate(pos) for pos in lps if pos is not None)
            row += n

    def _pool(self, out: SchedulerOutput, hidden: Any) -> None:
        """Hand embedding requests the hidden states of the positions they pool (one executor call a step)."""
        wanted = self._pool_spans(out)
        if wanted:
            self._add_pooled(wanted, self._run_guarded(self.executor.hidden_rows, hidden,
                                                       [(a, b) for _, _, a, b in wanted]).numpy())

    @staticmethod
    def _pool_spans(out: SchedulerOutput) -> list[_PoolSpan]:
        """The step's rows that embedding requests pool. Every entry counts: a prompt's last chunk of one token is
        scheduled among the decodes. (With a step in flight a request's state may lack that step's rows; its
        next chunk starts after them, and :meth:`PoolState.add` skips positions it has already.)"""
        row = 0
        wanted: list[_PoolSpan] = []
        for s in out.scheduled:
            state = s.request.pooling
            span = state.rows_wanted(s.num_computed_tokens, s.num_new_tokens) if state is not None else None
            if span is not None:
                first, stop = span
                start = s.num_computed_tokens
                wanted.append((state, first, row + first - start, row + stop - start))
            row += s.num_new_tokens
        return wanted

    @staticmethod
    def _add_pooled(wanted: list[_PoolSpan], rows: np.ndarray) -> None:
        """Give each request its rows of ``rows`` (those of ``wanted``, concatenated)."""
        at = 0
        for state, first, a, b in wanted:
            state.add(first, rows[at:at + b - a])
            at += b - a

    def _make_output(self, group: _Group) -> RequestOutput | PoolingRequestOutput:
        state = group.seqs[0].request.pooling
        if state is not None:
            req = group.seqs[0].request
            finished = group.finished
            vector = state.vector
            done = finished and not group.aborted and req.finish_reason != FinishReason.ABORT and vector is not None
            if state.params.task in _TOKEN_TASKS:   # one row per prompt position
                data = None
                if done and self.classifier is not None:   # (the rows are logits already: PoolState.reduce)
                    data = torch.from_numpy(self.classifier.activate(vector, state.params.use_activation is not False))
                elif done:
                    data = torch.from_numpy(finish_embeddings(vector, state.params, self.pooling))
                return PoolingRequestOutput(group.request_id, group.prompt_token_ids,
                                            PoolingOutput(data) if done else None, finished, req.num_cached_tokens,
                                            metrics=dataclasses.replace(req.metrics))
            if self.classifier is not None:
                probs = (ClassificationOutput(self.classifier.probs(vector, state.params.use_activation is not False))
                         if done else None)
                return ClassificationRequestOutput(group.request_id, group.prompt_token_ids, probs, finished,
                                                   req.num_cached_tokens, metrics=dataclasses.replace(req.metrics))
            embedding = EmbeddingOutput(finish_embedding(vector, state.params, self.pooling)) if done else None
            return PoolingRequestOutput(group.request_id, group.prompt_token_ids, embedding, finished,
                                        req.num_cached_tokens, metrics=dataclasses.replace(req.metrics))
        completions = []
        all_finished = True
        for i, seq in enumerate(group.seqs):
            req = seq.request
            reason = req.finish_reason
            if reason is None:
                if group.aborted:
                    reason = FinishReason.ABORT
                else:
                    all_finished = False
            detok = seq.detok
            completions.append(CompletionOutput(i, detok.emitted_text if detok is not None else "",
                                                list(req.output_token_ids), seq.cumulative_logprob,
                                                list(seq.logprobs) if seq.logprobs is not None else None,
                                                reason, req.stop_reason))
        first = group.seqs[0].request
        # the metrics as of this output (the request's own object goes on changing)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             group.aborted or all_finished, group.prompt_logprobs, dataclasses.replace(first.metrics),
                             first.num_cached_tokens, lora_request=group.lora_request, error=group.error,
                             num_prompt_embeds=group.num_prompt_embeds)

    # ----------------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_preemptions": s.num_preemptions,
            "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_hit_rate": s.prefix_cache.hit_rate,
            "prefix_cache": dataclasses.asdict(s.prefix_cache),
            **({"speculative": dict(dataclasses.asdict(self.speculative),
                                    acceptance_rate=self.speculative.acceptance_rate,
                                    mean_accepted_length=self.speculative.mean_accepted_length)}
               if self.speculative is not None else {}),
        }


def _state_slots(parts: Any) -> int:
    """The prefix-cache states the model keeps (every rank's: the fewest)."""
    from plinth.model_registry.layers.mamba import state_slots

    model = getattr(getattr(parts, "runner", None), "model", None)
    if model is not None:
        return state_slots(model) or 0
    slots = [n for n in parts.executor.apply_model(state_slots) if n is not None]   # (stages without such layers:
    return min(slots, default=0)                                                     # None)


def _has_recurrent_state(parts: Any) -> bool:
    """Whether the engine's model keeps per-sequence recurrent state (Mamba layers)."""
    model = getattr(getattr(parts, "runner", None), "model", None)
    if model is not None:
        return bool(getattr(model, "has_recurrent_state", False))
    source = getattr(parts, "source", None)   # worker processes hold the model: ask its class about the config
    if not getattr(source, "architecture", None):
        return False
    from plinth.worker.setup import recurrent_state_architecture

    return recurrent_state_architecture(source.architecture, source.hf_config)
