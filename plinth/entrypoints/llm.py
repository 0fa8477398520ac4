"""``plinth.LLM``: offline batch inference from Python."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from plinth.config import EngineConfig
from plinth.core.gc_pause import GcPause
from plinth.core.pooling import (
    MAX_TRUNCATED_CHARS,
    POOLING_TASKS,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    check_cross_encoder,
    cosine_scores,
    cut_pair,
    pair_types,
)
from plinth.core.request import RequestOutput, SamplingParams, cache_salt_problem
from plinth.errors import RequestFailedError
from plinth.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams

#: a prompt: text, token ids, or vLLM's dict forms ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``
PromptType = str | Sequence[int] | dict[str, Any]


#: what an engine of each task serves, and the LLM method for it
_TASK_USE = {"generate": "a text generation model: use LLM.generate or LLM.chat",
             "embed": "an embedding model (task='embed'): use LLM.embed or LLM.score",
             "classify": "a classifier (task='classify'): use LLM.classify (LLM.score for a one-label "
                         "cross-encoder; LLM.encode for a token classifier)"}


def _pair_prompt(engine: Any, first: Any, second: Any, keep: int | None) -> dict[str, Any]:
    """A cross-encoder's input: two texts tokenized as a pair, or two token-id lists joined; cut to ``keep`` tokens
    as the tokenizer cuts a pair (the longer first, both keeping their beginning); with its token types where the
    model reads segments (BERT)."""
    if isinstance(first, str) and isinstance(second, str):
        limit = None if keep is None else max(engine.chars_per_token * engine.max_model_len, MAX_TRUNCATED_CHARS)
        ids, types = engine.tokenize_pair(first, second, max_chars=limit, max_tokens=keep)
    elif isinstance(first, str) or isinstance(second, str):
        raise ValueError("a cross-encoder reads text_1 and text_2 together: give both as texts or both as token ids")
    elif not first or not second:
        raise ValueError(f"{'text_1' if not first else 'text_2'} must not hold an empty token list")
    else:   # (an encoder's special tokens at the lists' ends stay: only the text between is cut)
        ids, split = cut_pair(first, second, keep, engine.special_ids if getattr(engine, "encoder", False) else ())
        types = pair_types(len(ids), split) if engine.num_token_types > 1 else None
    return {"prompt_token_ids": ids, **({"token_type_ids": types} if types is not None else {})}


class _Salted(NamedTuple):
    """A dict prompt's text or token ids with its ``cache_salt``, its ``multi_modal_data`` and the settings of the
    image processor for its images, ``mm_processor_kwargs``, its ``token_type_ids``, and the text of its token ids
    that its output reports as ``prompt`` (each may be ``None``)."""

    prompt: Any
    salt: str | None
    multi_modal_data: Any = None
    processor_kwargs: Any = None
    token_type_ids: Any = None
    text: str | None = None


_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")
_PROMPT_OPTIONS = ("cache_salt", "multi_modal_data", "mm_processor_kwargs", "token_type_ids")


def _one_prompt(prompt: Any) -> Any:
    """A dict prompt as its text, token ids or :class:`~plinth.core.prompt_embeds.PromptEmbeds` (other forms as they
    are), as a :class:`_Salted` where it has a ``cache_salt``, ``multi_modal_data`` or ``token_type_ids``, or the text
    of its token ids as ``prompt`` (vLLM's ``TokensPrompt`` field)."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) & set(_PROMPT_KEYS)
    unknown = sorted(set(prompt) - {*_PROMPT_KEYS, *_PROMPT_OPTIONS}, key=repr)
    text = None   # vLLM's TokensPrompt may carry the ids' text as 'prompt', for the output
    if keys == {"prompt", "prompt_token_ids"}:
        keys.discard("prompt")
        text = prompt["prompt"]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"'prompt' must be text, got {type(text).__name__}")
    if len(keys) != 1 or unknown:
        raise ValueError(f"a dict prompt holds exactly one of 'prompt' (text), 'prompt_token_ids' (token ids) and "
                         f"'prompt_embeds' (a [positions, hidden_size] tensor) ('prompt' may go with "
                         f"'prompt_token_ids' as their text), and optionally 'cache_salt', "
                         f"'multi_modal_data', 'mm_processor_kwargs' and 'token_type_ids' (with token ids)"
                         f"{'; unknown keys: ' + ', '.join(map(repr, unknown)) if unknown else ''}")
    if "prompt_embeds" in prompt:
        from plinth.core.prompt_embeds import PromptEmbeds

        prompt = {**prompt, "prompt_embeds": PromptEmbeds(prompt["prompt_embeds"])}
    key = keys.pop()
    value = prompt[key]
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"'prompt' must be text, got {type(value).__name__}")
    if key == "prompt_token_ids" and (isinstance(value, str) or not isinstance(value, Sequence)
                                      and getattr(value, "ndim", None) != 1):
        raise ValueError(f"'prompt_token_ids' must be a list of token ids, got {type(value).__name__}")
    value = value.tolist() if getattr(value, "ndim", None) == 1 else value
    salt, mm, settings = prompt.get("cache_salt"), prompt.get("multi_modal_data"), prompt.get("mm_processor_kwargs")
    types = prompt.get("token_type_ids")
    if settings is not None and mm is None:
        raise ValueError("'mm_processor_kwargs' sets how the prompt's images are processed: give them in "
                         "'multi_modal_data'")
    if types is not None and "prompt_token_ids" not in prompt:
        raise ValueError("'token_type_ids' (one per token) go with 'prompt_token_ids'")
    if salt is None and mm is None and types is None and text is None:   # absent or null: nothing but the prompt
        return value
    problem = cache_salt_problem(salt)
    if problem is not None:
        raise ValueError(f"'cache_salt' {problem}")
    return _Salted(value, salt, mm, settings, types.tolist() if getattr(types, "ndim", None) == 1 else types, text)


def _unsalted(prompts: list[Any], what: str) -> list[Any]:
    """``prompts`` for a method that takes no ``cache_salt``: a clear error for one that has one."""
    if any(isinstance(p, _Salted) and (p.salt, p.multi_modal_data, p.token_type_ids) != (None, None, None)
           for p in prompts):
        raise ValueError(f"{what} takes no 'cache_salt', 'multi_modal_data' or 'token_type_ids' (give the prompts "
                         "as texts or token ids)")
    return [p.prompt if isinstance(p, _Salted) else p for p in prompts]


def _per_prompt_loras(lora_request: Any, count: int) -> list[Any]:
    """``lora_request`` (one for all, or one per prompt) as a list of ``count``."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, (str, bytes)) or not hasattr(lora_request, "__len__"):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, one per prompt, got {lora_request!r}")
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras


def _per_prompt_params(params: Any, kind: type, name: str, count: int) -> list[Any]:
    """``params``: one ``kind`` for all ``count`` prompts or a sequence of one per prompt, as a list of ``count``.

    Raises:
        TypeError: not a ``kind`` or a sequence, or an item that is not a ``kind``.
        ValueError: a sequence of another length."""
    if isinstance(params, kind):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, str | bytes):
        raise TypeError(f"{name} must be a {kind.__name__} (or one per prompt), got {type(params).__name__}")
    for p in params:
        if not isinstance(p, kind):
            raise TypeError(f"{name} must be a {kind.__name__} (or one per prompt), got {p!r} in the list")
    if len(params) != count:
        raise ValueError(f"got {len(params)} {name.replace('_', ' ')} for {count} prompts")
    return list(params)


def _integer_dtype(array: Any) -> bool:
    """A numpy array's or tensor's elements are integers (token ids), not strings or objects."""
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        return False
    if hasattr(dtype, "is_floating_point"):   # a torch dtype
        return not dtype.is_floating_point and not dtype.is_complex and str(dtype) != "torch.bool"
    return getattr(dtype, "kind", "") in ("i", "u")


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a list of token ids, a 1-D numpy array or tensor of them, a dict) or several,
    as a list of strings and token-id lists."""
    if getattr(prompts, "ndim", None) == 1 and _integer_dtype(prompts):   # numpy / torch token ids: one prompt
        return [prompts.tolist()]
    if isinstance(prompts, str | dict) or (isinstance(prompts, Sequence) and prompts
                                           and isinstance(prompts[0], numbers.Integral)):
        return [_one_prompt(prompts)]
    if not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
        raise TypeError(f"prompts must be a prompt (text, token ids or a dict) or a list of them, "
                        f"got {type(prompts).__name__}")
    return [_one_prompt(p) for p in prompts]


class LLM:
    """Generate text for many prompts at once, with continuous batching.

    Args:
        model: a HF model directory, a ``.gguf`` file, or a preset with ``load_format="dummy"``;
            ``None`` loads the default model (SmolLM2-135M-Instruct).
        **kwargs: any engine option (``dtype``, ``max_model_len``, ``block_size``,
            ``max_num_seqs``, ``attention_backend``, ...; see :class:`plinth.config.EngineConfig`).

    Example::

        llm = LLM()
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)

    The worker processes of a tensor- or pipeline-parallel engine stop on :meth:`close` (or when a
    ``with LLM(...) as llm:`` block ends), when the engine is garbage-collected (``del llm``, unless
    ``llm.engine`` is still referenced elsewhere), or when the interpreter exits.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        with GcPause():   # the start-up's imports and model build: no garbage to collect
            from plinth.core.engine import LLMEngine
            from plinth.plugins import get_plugin_manager

            pm = get_plugin_manager()
            # options that plugins add (their command-line flags, by dest name) go to their hook only
            extra = set(kwargs) - EngineConfig.option_names()
            plugin_options = pm.cli_option_names() if extra else frozenset()
            config = EngineConfig.from_kwargs(model=model, **{k: v for k, v in kwargs.items()
                                                              if k not in extra or k not in plugin_options})
            config = pm.apply_engine_config_overrides(config, dict(kwargs, model=model))
            self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._lock = threading.RLock()   # generate/embed from several threads: one steps the engine at a time
        # stops the workers once: on close(), when the engine is collected, or at interpreter exit
        self._finalizer = weakref.finalize(self.engine, self.engine.executor.shutdown)

    def close(self) -> None:
        """Shut the engine down and stop its workers (idempotent; bounded time). The LLM cannot
        generate afterwards."""
        self.engine.shutdown()
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for :attr:`engine`)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, so that no later prompt reuses KV computed before (after new weights, or
        between benchmark runs); see ``LLMEngine.reset_prefix_cache``. Waits for a ``generate`` running in
        another thread, so it returns ``True`` unless requests added to ``llm.engine`` directly still run."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    def update_weights(self, weights: Any, reset_prefix_cache: bool = True) -> int:
        """Load new values into the model's weights in place (a reinforcement-learning loop's trained copy, between
        rounds of ``generate``): a ``state_dict()``, ``(name, tensor)`` pairs (``model.named_parameters()``) or the
        path of a safetensors checkpoint, with the checkpoint names of the architecture, all weights or some; the
        number of tensors loaded. Forgets the prefix cache unless ``reset_prefix_cache=False``. See
        ``LLMEngine.update_weights`` (what cannot be updated, and the errors)."""
        with self._lock:
            return self.engine.update_weights(weights, reset_prefix_cache)

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """``fn(model)`` on the model of every rank (vLLM's ``apply_model``): inspect or change it in place; the
        results in rank order. See ``LLMEngine.apply_model``."""
        with self._lock:
            return self.engine.apply_model(fn)

    def sleep(self, level: int = 1) -> None:
        """Give the KV cache's memory back, and on an accelerator the weights' (an ``LLM`` made with
        ``enable_sleep_mode=True``): level 1 keeps the weights in host memory, level 2 discards them (load new ones
        with :meth:`update_weights` after ``wake_up(tags=["weights"])``). See ``LLMEngine.sleep``."""
        with self._lock:
            self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: every part, or ``tags`` of ``"weights"`` and ``"kv_cache"``. See
        ``LLMEngine.wake_up``."""
        with self._lock:
            self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether any part of the engine sleeps."""
        return self.engine.is_sleeping()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of ``prompts``.

        ``prompts`` is a string, a list of token ids, a dict (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``,
        either with an optional ``"cache_salt"``: see :meth:`~plinth.core.engine.LLMEngine.add_request`; the token ids
        with an optional ``"prompt"``, their text, which the output reports as its ``prompt``), or a list of these.
        ``sampling_params`` is one for all prompts or one per prompt (default:
        :meth:`get_default_sampling_params`).
        ``priority``: one per prompt, lower first (an engine with ``scheduling_policy="priority"``).
        ``lora_request``: a :class:`~plinth.lora.LoRARequest` for every prompt, or one (or ``None``) per prompt
        (an engine with ``enable_lora=True``).
        """
        if self.engine.task != "generate":
            from plinth.core.scheduler import RequestRejectedError

            raise RequestRejectedError(f"this LLM serves {_TASK_USE[self.engine.task]}")
        prompts = _prompt_list(prompts)
        params_list = _per_prompt_params(sampling_params if sampling_params is not None
                                         else self.get_default_sampling_params(), SamplingParams, "sampling_params",
                                         len(prompts))
        if priority is not None and (isinstance(priority, str) or not hasattr(priority, "__len__")):
            raise ValueError(f"priority must be a list of integers, one per prompt, got {priority!r}")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._submit_and_run(zip(prompts, params_list, priorities, loras, strict=True), use_tqdm)

    def _submit_and_run(self, requests: Any, use_tqdm: bool) -> list[Any]:
        """Queue the requests and step the engine until they finish. One caller at a time: the stepping caller
        takes only its own requests' outputs, so another thread's would be lost and that thread would wait for
        ever."""
        requests = list(requests)
        texts = [r[0].text if isinstance(r[0], _Salted) else None for r in requests]
        with self._lock:
            return self._run(self._submit(requests), use_tqdm, texts)

    def _submit(self, requests: Any) -> list[str]:
        """Queue ``(prompt, params, priority, lora_request)`` tuples; their ids. A rejected prompt leaves none of
        them queued."""
        ids: list[str] = []
        requests = list(requests)
        prepared = self._prepare_media([r[0] for r in requests])
        try:
            with GcPause():   # (queuing a batch makes many objects and no garbage: no collections scanning them)
                for i, (prompt, params, rank, lora) in enumerate(requests):
                    rid = f"llm-{next(self._ids)}"
                    prompt, salt, mm, _, types, _ = (prompt if isinstance(prompt, _Salted)
                                                     else (prompt, None, None, None, None, None))
                    mm = prepared.get(i, mm)
                    self.engine.add_request(rid, prompt, params, priority=rank, lora_request=lora, cache_salt=salt,
                                            multi_modal_data=mm, token_type_ids=types)
                    ids.append(rid)
        except BaseException:
            if ids:
                self.engine.abort_request(ids)
                self.engine.step(final_only=True)   # reports (and forgets) the aborted requests
            raise
        return ids

    def _prepare_media(self, prompts: list[Any]) -> dict[int, Any]:
        """The prompts' images and videos through the image processor (each prompt with its own settings), several
        prompts' at once on the media threads (the processors resize in native code, off the interpreter lock): prompt
        index -> :class:`~plinth.multimodal.images.PreparedImages`. A prompt the processor refuses raises here, before
        any request is queued."""
        support = self.engine.images
        jobs = [(i, p.multi_modal_data, p.processor_kwargs) for i, p in enumerate(prompts)
                if isinstance(p, _Salted) and p.multi_modal_data is not None]
        if support is None or not jobs or (len(jobs) == 1 and not jobs[0][2]):
            return {}   # (one prompt: processed as it is added)
        if len(jobs) == 1:
            return {jobs[0][0]: support.prepare(jobs[0][1], jobs[0][2])}
        from plinth.multimodal.images import media_pool

        futures = [(i, media_pool().submit(support.prepare, mm, settings)) for i, mm, settings in jobs]
        return {i: future.result() for i, future in futures}

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Embeddings of ``prompts`` (an engine made with ``task="embed"``), in prompt order: each output's
        ``outputs.embedding`` is a list of floats (see :mod:`plinth.core.pooling`). ``truncate_prompt_tokens``
        (vLLM's keyword): every prompt's last N tokens only, as ``PoolingParams(truncate_prompt_tokens=N)``.

        Raises:
            RequestRejectedError: the engine generates text, or a prompt cannot run (empty, too long).
        """
        self._need_task("embed", "LLM.embed")
        return self._pool(prompts, pooling_params, lora_request, use_tqdm, truncate_prompt_tokens, "embed")

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's label probabilities for each prompt (an engine made with ``task="classify"``),
        in prompt order: ``outputs.probs``, one per label in the order of :attr:`labels` (raw logits with
        ``PoolingParams(use_activation=False)``).

        Raises:
            RequestRejectedError: the engine is not a classifier, or a prompt cannot run (empty, too long).
        """
        self._need_task("classify", "LLM.classify")
        return self._pool(prompts, pooling_params, lora_request, use_tqdm, truncate_prompt_tokens, "classify")

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output as a tensor (vLLM's ``LLM.encode``), in prompt order: ``outputs.data``, float32.
        ``pooling_task`` (else each ``PoolingParams.task``, else the engine's own) is one of

        - ``embed`` (an embedding engine): the embedding, ``[dim]``, as :meth:`embed` gives it;
        - ``token_embed`` (an embedding engine): each prompt token's final hidden state, ``[tokens, dim]``,
          normalized as the embeddings are (``PoolingParams.normalize``, ``dimensions``);
        - ``classify`` (a sequence classifier): the label probabilities, ``[labels]``, as :meth:`classify`;
        - ``token_classify`` (a token classifier, ``*ForTokenClassification``: the default there; a decoder's sequence
          classifier too): each prompt token's label probabilities, ``[tokens, labels]`` (raw logits with
          ``PoolingParams(use_activation=False)``).

        A per-token request computes its whole prompt (no prefix-cache hits).

        Raises:
            RequestRejectedError: the engine generates text, a task the model does not serve, or a prompt that
                cannot run (empty, too long).
        """
        import torch

        if self.engine.task == "generate":
            from plinth.core.scheduler import RequestRejectedError

            raise RequestRejectedError(f"LLM.encode needs an embedding or classification engine: this LLM serves "
                                       f"{_TASK_USE[self.engine.task]}")
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}")
        outputs = self._pool(prompts, pooling_params, lora_request, use_tqdm, truncate_prompt_tokens, pooling_task)
        for out in outputs:   # (a whole-prompt task's embedding or probabilities as a tensor, as the others')
            if isinstance(out.outputs, EmbeddingOutput | ClassificationOutput):
                values = out.outputs.embedding if isinstance(out.outputs, EmbeddingOutput) else out.outputs.probs
                out.outputs = PoolingOutput(torch.tensor(values, dtype=torch.float32))
        return outputs

    @property
    def labels(self) -> tuple[str, ...]:
        """A sequence classifier's label names (its config's ``id2label``), in the order of ``outputs.probs``."""
        self._need_task("classify", "LLM.labels")
        return self.engine.classifier.labels   # type: ignore[union-attr]

    def _need_task(self, task: str, what: str) -> None:
        if self.engine.task != task:
            from plinth.core.scheduler import RequestRejectedError

            raise RequestRejectedError(f"{what} needs an engine made with task={task!r}: this LLM serves "
                                       f"{_TASK_USE[self.engine.task]}")

    def _pool(self, prompts: Any, pooling_params: Any, lora_request: Any, use_tqdm: bool,
              truncate_prompt_tokens: int | None, task: str | None) -> list[Any]:
        prompts = _prompt_list(prompts)
        params_list = _per_prompt_params(pooling_params if pooling_params is not None else PoolingParams(),
                                         PoolingParams, "pooling_params", len(prompts))
        if truncate_prompt_tokens is not None:
            params_list = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        if task is not None:
            params_list = [dataclasses.replace(p, task=task) for p in params_list]
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._submit_and_run(((prompt, params, 0, lora) for prompt, lora, params
                                     in zip(prompts, loras, params_list, strict=True)), use_tqdm)

    def score(self, text_1: PromptType | Sequence[PromptType], text_2: PromptType | Sequence[PromptType], *,
              lora_request: LoRARequest | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """``text_1`` against each of ``text_2``, or the pairs of two lists of the same length; each pair's score as
        ``outputs.score`` (vLLM's ``ScoringRequestOutput``): the cosine similarity of their embeddings (an engine
        made with ``task="embed"``: a bi-encoder), or a one-label sequence classifier's probability for the two
        read together (``task="classify"``: a cross-encoder; texts tokenized as a pair, token ids joined).
        ``truncate_prompt_tokens``: each text's last N tokens (embeddings), or each pair cut to N tokens as the
        tokenizer cuts a pair, the longer text first, both keeping their beginning (a cross-encoder).

        Raises:
            ValueError: an empty list, or two lists of different lengths.
            RequestRejectedError: the engine generates text, a classifier with more than one label, or a prompt
                cannot run.
        """
        first, second = _unsalted(_prompt_list(text_1), "LLM.score"), _unsalted(_prompt_list(text_2), "LLM.score")
        if not first or not second:
            raise ValueError("text_1 and text_2 must not be empty")
        if len(first) != 1 and len(first) != len(second):
            raise ValueError(f"text_1 holds {len(first)} prompts and text_2 {len(second)}: give one text_1, or as "
                             f"many as text_2")
        if self.engine.task == "classify":
            return self._cross_encode(first * len(second) if len(first) == 1 else first, second, lora_request,
                                      use_tqdm, truncate_prompt_tokens)
        outs = self.embed([*first, *second], PoolingParams(normalize=True), lora_request=lora_request,
                          use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        left, right = outs[:len(first)], outs[len(first):]
        scores = cosine_scores([o.outputs.embedding for o in left], [o.outputs.embedding for o in right])
        pairs = zip(left * len(right) if len(left) == 1 else left, right, strict=True)
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}", a.prompt_token_ids + b.prompt_token_ids,
                                     ScoringOutput(score)) for (a, b), score in zip(pairs, scores, strict=True)]

    def _cross_encode(self, first: list[Any], second: list[Any], lora_request: LoRARequest | None,
                      use_tqdm: bool, keep: int | None) -> list[ScoringRequestOutput]:
        from plinth.core.request import truncation_problem
        from plinth.core.scheduler import RequestRejectedError

        check_cross_encoder(self.engine.classifier)
        if keep is not None:
            problem = truncation_problem(keep)
            if problem is not None:
                raise ValueError(f"truncate_prompt_tokens {problem}")
            if keep > self.engine.max_model_len:
                raise RequestRejectedError(f"truncate_prompt_tokens is {keep}, more than max_model_len "
                                           f"({self.engine.max_model_len})", param="truncate_prompt_tokens")
            keep = self.engine.max_model_len if keep == -1 else keep
        pairs = [_pair_prompt(self.engine, a, b, keep) for a, b in zip(first, second, strict=True)]
        outs = self.classify(pairs, lora_request=lora_request, use_tqdm=use_tqdm)
        if any(o.outputs is None for o in outs):
            raise RequestRejectedError("a pair ended without a score")
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.outputs.probs[0]))
                for o in outs]

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's recommended settings on top: its ``generation_config.json``
        (or ``generation_config=`` / ``override_generation_config=``; see
        :mod:`plinth.model_registry.generation_config`). Start from it to keep them:
        ``dataclasses.replace(llm.get_default_sampling_params(), max_tokens=64)``."""
        return self.engine.default_sampling_params()

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    ) -> list[BeamSearchOutput]:
        """Beam search (:mod:`plinth.entrypoints.beam_search`): each prompt's ``params.beam_width`` best
        sequences, best first (``lora_request``: with that LoRA adapter, or one per prompt for its beams)."""
        from plinth.entrypoints.beam_search import beam_search

        prompts = _prompt_list(prompts)
        return beam_search(self, prompts, params, _per_prompt_loras(lora_request, len(prompts)))

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted with the model's chat template (``tools``: OpenAI's
        function definitions, for templates that show them to the model; ``continue_final_message``: go on
        with the last message instead of starting a reply, with ``add_generation_prompt=False``;
        ``chat_template_kwargs``: more template variables, e.g. ``{"enable_thinking": False}``)."""
        from plinth.entrypoints.openai.tools import plain_messages

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        support = self.engine.images
        collected = [support.parts() if support is not None else None for _ in conversations]
        conversations = [plain_messages(conv, images)  # type: ignore[arg-type]
                         for conv, images in zip(conversations, collected, strict=True)]
        texts = [self.engine.render_chat(conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                                         tools=tools, continue_final_message=continue_final_message,
                                         template_kwargs=chat_template_kwargs)
                 for conv in conversations]  # type: ignore[arg-type]
        # The template writes the special tokens itself: tokenize without adding BOS again.
        prompts: list[Any] = [self.engine.tokenize(text, add_special_tokens=False) for text in texts]
        prompts = [{"prompt_token_ids": ids, "multi_modal_data": images.multi_modal_data()}
                   if images is not None and images.multi_modal_data() else ids
                   for ids, images in zip(prompts, collected, strict=True)]
        try:
            outputs = self.generate(prompts, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)
        except RequestFailedError as exc:   # the outputs it carries get their prompts too
            for out, text in zip(exc.outputs, texts, strict=True):
                out.prompt = text
            raise
        for out, text in zip(outputs, texts, strict=True):   # each output's prompt: the rendered conversation
            out.prompt = text
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool, texts: Sequence[str | None] = ()) -> list[RequestOutput]:
        """Step the engine until the requests ``ids`` finish; their outputs in order (``texts``: the prompt text
        each output reports, where a dict prompt gave its token ids' text)."""
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            desc = {"embed": "embedding", "classify": "classifying"}.get(self.engine.task, "generating")
            bar = tqdm(total=len(ids), desc=desc, unit="req", dynamic_ncols=True)
        try:
            while pending:
                for out in self.engine.step(final_only=True):
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request(list(pending))
            self.engine.step(final_only=True)   # reports (and forgets) the aborted requests
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [results[i] for i in ids]
        for out, text in zip(outputs, texts, strict=False):
            if text is not None and hasattr(out, "prompt"):   # (a pooling output reports no prompt)
                out.prompt = text
        failed = [out for out in outputs if getattr(out, "error", None)]
        if failed:   # after every request is done: the others' work is in the error's outputs
            raise RequestFailedError(f"{len(failed)} of {len(ids)} request(s) failed; the first: {failed[0].error}",
                                     outputs)
        return outputs
