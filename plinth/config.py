"""Engine configuration: frozen dataclasses, validated once at construction.

Every validation failure raises :class:`ConfigError` (a ``ValueError``) whose
message names the offending option and says what would be accepted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from plinth.model_registry.generation_config import SAMPLING_KEYS

DTYPES = ("auto", "float32", "float16", "bfloat16")
#: other names of DTYPES, as vLLM and torch take them
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SELECTION_MODES = ("benchmark", "cached", "off")
EXECUTORS = ("auto", "uniproc", "mp", "ray")
TASKS = ("generate", "embed", "classify")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
POOLING_TYPES = ("last", "mean", "cls")
#: what ``logprobs`` report (vLLM's ``logprobs_mode``): the model's own distribution or the one a token was drawn from
#: (after the sampling parameters), as log-probabilities or as logits
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
#: vLLM's engine option names for plinth's own
VLLM_OPTION_NAMES = {"distributed_executor_backend": "distributed_executor"}
#: vLLM's engine options that change nothing here, and why (taken, so that vLLM scripts run)
VLLM_NO_EFFECT_OPTIONS = {
    "swap_space": "a preempted request's KV cache is recomputed, never swapped to host memory",
    "disable_log_stats": "the offline engine logs no periodic statistics",
}
#: how chat templates see a message's text content (vLLM's ``--chat-template-content-format``)
CONTENT_FORMATS = ("auto", "string", "openai")
SPECULATIVE_METHODS = ("ngram", "draft_model")
#: the keys ``override_generation_config`` takes
GENERATION_CONFIG_KEYS = tuple(SAMPLING_KEYS)


#: the longest wait a timeout may set: a week (longer ones, ``inf`` included, overflow the waits they bound)
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class ConfigError(ValueError):
    """An invalid configuration value; the message says which option and why."""


def env_flag(name: str, default: bool) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case); unset: ``default``.

    Raises:
        ConfigError: any other value.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


#: on/off switches that kernels read where they run (a bad value there would only turn them off or on): checked
#: with every engine configuration instead, so a bad value is an error at start-up
KERNEL_SWITCHES = ("PLINTH_CPU_NATIVE_OPS", "PLINTH_CPU_AMX", "PLINTH_FUSED_OPS", "PLINTH_CPU_PAGED_ATTENTION",
                   "PLINTH_CPU_SDPA_PREFILL")
#: the CPU the native kernels are built for (``-march=VALUE``; default ``native``) and the form of a value
MARCH_ENV, MARCH_PATTERN = "PLINTH_CPU_MARCH", r"[A-Za-z0-9_.+-]+"


def check_march() -> None:
    """Refuse a ``$PLINTH_CPU_MARCH`` that is no ``-march`` value (it reaches a compiler's command line).

    Raises:
        ConfigError: naming the variable.
    """
    march = os.environ.get(MARCH_ENV, "").strip()
    if march and not re.fullmatch(MARCH_PATTERN, march):
        raise ConfigError(f"{MARCH_ENV}={march!r} is not a -march value (letters, digits and _.+- only)")


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: the process's umask when plinth was imported (read once: setting it to read it is not thread-safe)
UMASK = _read_umask()


def shared_mode(mode: int) -> int:
    """``mode`` as the umask allows it: for cache files written through ``mkstemp`` (private, 0600), which other
    users of the cache read as they read the model files."""
    return mode & ~UMASK


def cache_dir() -> Path:
    """plinth's cache directory: ``$PLINTH_CACHE_DIR`` or ``~/.cache/plinth``."""
    root = os.environ.get("PLINTH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "plinth"
    )
    return Path(root)


def _json_text(name: str, value: Any) -> Any:
    """An option given as a value or as its JSON text: the value.

    Raises:
        ConfigError: text that is not JSON.
    """
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not valid JSON: {exc}") from None


def _positive(name: str, value: int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


#: the most sequences a batch may hold (each takes rows of per-step host arrays sized by the context's blocks)
MAX_NUM_SEQS = 1 << 16


def _check_texts(config: Any, names: tuple[str, ...], paths: tuple[str, ...] = ()) -> None:
    """Fields that hold a name or text (or None): anything else is a ConfigError naming the field; those in ``paths``
    may be given as a path object (kept as its text)."""
    for name in names:
        value = getattr(config, name)
        if name in paths and isinstance(value, os.PathLike):
            object.__setattr__(config, name, os.fspath(value))
        elif value is not None and not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")


def _check_flags(config: Any) -> None:
    """Every ``bool`` field of a config dataclass holds a bool (``bool | None`` fields may hold None): a
    string such as ``"false"`` would otherwise count as true."""
    for field in dataclasses.fields(config):
        if field.type in ("bool", "bool | None"):
            value = getattr(config, field.name)
            if not isinstance(value, bool) and not (value is None and field.type == "bool | None"):
                raise ConfigError(f"{field.name} must be true or false, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What to load.

    Attributes:
        model: a HF-style model directory, a ``.gguf`` file, or a preset name with
            ``load_format="dummy"``; ``None`` means the default model.
        tokenizer: a tokenizer directory (default: taken from the model).
        dtype: the compute dtype; ``auto`` takes the checkpoint's (float32 on CPUs without bf16).
        max_model_len: the longest sequence (prompt + output); default: the model's.
        load_format: ``auto`` (by file type), ``safetensors``, ``gguf`` or ``dummy`` (random weights).
        quantization: a quantization method name, or ``None`` for the checkpoint's own.
        quantize_lm_head: quantize the LM head too, with the method's float-weight quantizer (``int4``,
            ``fp8``); off by default, as in most checkpoints: the logits come from the float weight.
        trust_remote_code: allow transformers to run code shipped with a checkpoint.
        seed: the seed for random weights and for requests that have no seed.
        served_model_name: the model name the server reports and accepts (given several, as a list: the first is
            reported, every one accepted; the others are kept in ``served_model_aliases``).
        chat_template: a jinja2 chat template (text or a file path) replacing the tokenizer's.
        chat_template_content_format: how templates see a message's text: ``string`` (its text parts joined by
            line breaks), ``openai`` (a list of ``{"type": "text", "text"}`` parts), or ``auto`` (parts for a
            template that loops over ``content``, else the string).
        generation_config: where the default sampling settings come from
            (:mod:`plinth.model_registry.generation_config`): ``auto`` (the model folder's
            ``generation_config.json``), ``none``, or a folder or JSON file.
        hf_overrides: ``config.json`` keys set on top before the model is built (a dict or its JSON text, kept as
            sorted JSON text; vLLM's option), e.g. ``{"max_position_embeddings": 65536}`` or a causal LM read as a
            cross-encoder (``classifier_from_token``, see :mod:`plinth.core.pooling`). A model directory or a
            dummy preset; not a GGUF file.
        override_generation_config: generation-config keys set on top (a dict or its JSON text; kept as
            sorted ``(key, value)`` pairs).
        reasoning_parser: the model's thinking markers (a registered reasoning parser, e.g. ``qwen3``):
            structured-output constraints then start after the thinking.
        task: ``generate`` (text), ``embed`` (embedding vectors) or ``classify`` (a sequence classifier's label
            probabilities; see :mod:`plinth.core.pooling`).
        pooling: an embedding model's pooling (``last``, ``mean``, ``cls``; default: the model's
            sentence-transformers configuration, else ``last``).
        normalize_embeddings: L2-normalize embeddings (default: as the model's configuration says, else yes).
        max_logprobs: the most log-probabilities a request may ask for per position (``logprobs``,
            ``prompt_logprobs``; -1: no limit, so that ``-1``, the whole vocabulary, may be asked for).
        logprobs_mode: what ``logprobs`` report (vLLM's option): ``raw_logprobs`` (the model's log-probabilities;
            the default), ``processed_logprobs`` (those of the distribution the token was drawn from: after custom
            processors, masks, bias, penalties, temperature, min-p, top-k and top-p, ``-inf`` for dropped tokens),
            or ``raw_logits`` / ``processed_logits`` (the same steps' logits). Prompt logprobs are the model's
            (log-probabilities, or logits in the two logits modes).
        logits_processors: custom logits processors (:mod:`plinth.core.logits_processors`), in the order they
            run: names plugins register, ``"package.module:Class"`` references or the classes themselves (kept
            as a tuple).
        limit_mm_per_prompt: the most images and videos a prompt of an image-and-text model may carry (``{"image":
            N, "video": M}`` or its JSON text; default 16 images and 4 videos; kept as that dict).
        allowed_local_media_path: a directory whose files ``file://`` image URLs may name (default: none).
        allowed_media_domains: hosts whose ``http(s)://`` image URLs are fetched, with their subdomains (``*``: any;
            default: none, so only data URLs are taken).
        mm_processor_kwargs: settings of the checkpoint's image processor (a dict or its JSON text), e.g. Qwen2-VL's
            ``{"min_pixels": ..., "max_pixels": ...}``, which bound the positions an image fills.
        enable_prompt_embeds: take prompts given as embeddings (``prompt_embeds``; see
            :mod:`plinth.core.prompt_embeds`).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    quantization: str | None = None
    quantize_lm_head: bool = False
    trust_remote_code: bool = False
    seed: int = 0
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    generation_config: str = "auto"
    override_generation_config: Any = None
    hf_overrides: Any = None
    reasoning_parser: str | None = None
    task: str = "generate"
    pooling: str | None = None
    normalize_embeddings: bool | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    logits_processors: Any = ()
    limit_mm_per_prompt: Any = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: Any = None
    mm_processor_kwargs: Any = None
    enable_prompt_embeds: bool = False

    def _check_media(self) -> None:
        """``limit_mm_per_prompt`` as its image count, ``allowed_media_domains`` as a tuple of lower-case hosts."""
        limit = _json_text("limit_mm_per_prompt", self.limit_mm_per_prompt)
        if limit is not None:
            if not isinstance(limit, dict) or set(limit) - {"image", "video"}:
                raise ConfigError(f"limit_mm_per_prompt must be a JSON object such as {{\"image\": 4, \"video\": 1}} "
                                  f"(images and videos are the inputs besides text), got {self.limit_mm_per_prompt!r}")
            for kind, count in limit.items():   # (None: the default)
                if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                    raise ConfigError(f"limit_mm_per_prompt's {kind} count must be an integer >= 0, got {count!r}")
            limit = {kind: count for kind, count in limit.items() if count is not None}
        object.__setattr__(self, "limit_mm_per_prompt", limit)
        domains = self.allowed_media_domains
        if isinstance(domains, str):
            domains = [d for d in domains.split(",") if d.strip()]
        if domains is not None:
            if not isinstance(domains, list | tuple) or not all(isinstance(d, str) and d.strip() for d in domains):
                raise ConfigError(f"allowed_media_domains must be a list of host names, got "
                                  f"{self.allowed_media_domains!r}")
            domains = tuple(d.strip().lower().rstrip(".") for d in domains)
        object.__setattr__(self, "allowed_media_domains", domains)
        settings = _json_text("mm_processor_kwargs", self.mm_processor_kwargs)
        if settings is not None and (not isinstance(settings, dict) or not all(isinstance(k, str) for k in settings)):
            raise ConfigError(f"mm_processor_kwargs must be a JSON object of the image processor's settings, such as "
                              f"{{\"max_pixels\": 1003520}}, got {self.mm_processor_kwargs!r}")
        object.__setattr__(self, "mm_processor_kwargs", settings)

    def __post_init__(self) -> None:
        _check_flags(self)
        self._check_media()
        procs = self.logits_processors
        procs = (procs,) if isinstance(procs, str | type) else procs
        if not isinstance(procs, list | tuple) or not all(isinstance(p, str | type) and p for p in procs):
            raise ConfigError(f"logits_processors must be a list of processor names, 'package.module:Class' "
                              f"references or classes, got {self.logits_processors!r}")
        object.__setattr__(self, "logits_processors", tuple(procs))
        _check_texts(self, ("tokenizer", "chat_template", "allowed_local_media_path"),
                     paths=("tokenizer", "chat_template", "allowed_local_media_path"))
        for name in ("tokenizer", "allowed_local_media_path"):   # "~/tokenizers/x", as the model's path is taken
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.path.expanduser(getattr(self, name)))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64:
            raise ConfigError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        aliases = self.served_model_aliases
        if not isinstance(aliases, list | tuple) or not all(isinstance(a, str) and a for a in aliases):
            raise ConfigError(f"served_model_aliases must be a list of names, got {aliases!r}")
        object.__setattr__(self, "served_model_aliases",
                            tuple(dict.fromkeys(a for a in aliases if a != self.served_model_name)))
        names = self.served_model_name
        if isinstance(names, list | tuple):
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"served_model_name must be a name or a list of names, got {names!r}")
            object.__setattr__(self, "served_model_name", names[0])
            object.__setattr__(self, "served_model_aliases",
                                tuple(dict.fromkeys(n for n in [*names[1:], *self.served_model_aliases]
                                                    if n != names[0])))
        elif names is not None and (not isinstance(names, str) or not names):
            raise ConfigError(f"served_model_name must be a name or a list of names, got {names!r}")
        overrides = _json_text("hf_overrides", self.hf_overrides)
        if overrides is not None and not isinstance(overrides, dict):
            raise ConfigError(f"hf_overrides must be a JSON object of config.json keys, got {self.hf_overrides!r}")
        try:
            object.__setattr__(self, "hf_overrides", json.dumps(overrides, sort_keys=True) if overrides else None)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"hf_overrides must hold JSON values: {exc}") from None
        override = _json_text("override_generation_config", self.override_generation_config)
        if isinstance(override, dict):
            override = tuple(sorted(override.items()))
        if override is not None and not (isinstance(override, tuple)
                                         and all(isinstance(kv, tuple) and len(kv) == 2 for kv in override)):
            raise ConfigError(f"override_generation_config must be a JSON object, got {self.override_generation_config!r}")
        unknown = sorted(k for k, _ in override or () if k not in GENERATION_CONFIG_KEYS)
        if unknown:
            raise ConfigError(f"override_generation_config: unknown key(s) {', '.join(map(repr, unknown))}; it takes "
                              f"{', '.join(GENERATION_CONFIG_KEYS)}")
        object.__setattr__(self, "override_generation_config", override or None)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(f"generation_config must be 'auto', 'none' or a path, got {self.generation_config!r}")
        if self.max_logprobs != -1:   # -1: no cap (as vLLM's)
            _positive("max_logprobs", self.max_logprobs, allow_none=False)
        if self.max_logprobs > 1 << 20:
            raise ConfigError(f"max_logprobs must be at most {1 << 20}, got {self.max_logprobs}")
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ConfigError(f"allowed_local_media_path must be a directory, got {self.allowed_local_media_path!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.logits_processors and self.task != "generate":
            raise ConfigError(f"logits_processors apply to generation; task {self.task!r} samples no tokens")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
                              f"{self.chat_template_content_format!r}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ConfigError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, str):
            raise ConfigError(f"reasoning_parser must be a parser's name, got {self.reasoning_parser!r}")
        if (self.pooling is not None or self.normalize_embeddings is not None) and self.task != "embed":
            raise ConfigError("pooling and normalize_embeddings need task='embed'")
        dtype = self.dtype if isinstance(self.dtype, str) else str(self.dtype).removeprefix("torch.")   # torch.bfloat16
        dtype = DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)}, or a torch "
                              f"dtype), got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        _positive("max_model_len", self.max_model_len)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: force the number of KV blocks (default: sized from memory).
        gpu_memory_utilization: the fraction of device memory plinth may use in all
            (weights, activations and KV cache) on accelerators.
        cpu_kv_cache_bytes: KV-cache bytes on the CPU platform (default: 2 GiB).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        kv_cache_dtype: ``auto`` (the model's dtype) or ``fp8`` / ``fp8_e4m3`` (float8 e4m3) / ``fp8_e5m2``: keys
            and values stored in 8 bits (twice the tokens in the same memory, half the bytes read per attention
            step), rounded when written, with a scale of 1 (no calibration); ``bfloat16``: keys and values of a
            float32 model rounded to bfloat16 (the same as ``auto`` for a bfloat16 model).
        mamba_cache_slots: models with Mamba layers, prefix cache on: how many states (each the size of one
            sequence's) the prefix cache keeps, at block boundaries (default: ``max_num_seqs``, fewer if they do
            not fit half the free memory; 0: no prefix cache for such models).
    """

    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    mamba_cache_slots: int | None = None

    def __post_init__(self) -> None:
        _check_flags(self)
        if self.mamba_cache_slots is not None and (not isinstance(self.mamba_cache_slots, int) or isinstance(
                self.mamba_cache_slots, bool) or self.mamba_cache_slots < 0):
            raise ConfigError(f"mamba_cache_slots must be a non-negative integer, got {self.mamba_cache_slots!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _positive("block_size", self.block_size, allow_none=False)
        _positive("num_blocks", self.num_blocks)
        if self.num_blocks == 1:
            raise ConfigError("num_blocks must be at least 2 (block 0 is reserved for padding), got 1")
        _positive("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes, allow_none=False)
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0.0 < utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    Attributes:
        max_num_seqs: the most requests running at once (None: the platform's default for the
            device, see ``Platform.scheduler_defaults``; 256 unless the platform says otherwise).
        max_num_batched_tokens: the token budget of one step, decodes plus prefill chunks (None: the
            platform's default; 2048 unless the platform says otherwise).
        enable_chunked_prefill: split long prompts over several steps.
        max_waiting_requests: the most requests queued beyond the running batch's free places before new ones
            are refused (None: unbounded).
        async_scheduling: schedule and launch step N+1 before reading step N's sampled tokens, which
            feed step N+1 on the device (None: on for accelerators where the executor supports it; steps
            whose requests ask for penalties, prompt logprobs or structured outputs run synchronously).
        itl_target_ms: the inter-token latency to keep while sequences decode: a step that carries
            decodes takes only the prefill tokens a fitted cost model predicts fit in this time (at
            least one block's worth, so prompts keep moving). 0: off (the default). Synchronous steps
            only (with asynchronous scheduling the engine warns and keeps it off).
        scheduling_policy: ``fcfs`` (first come, first served; the default) or ``priority``: waiting
            requests are admitted by their ``priority`` (lower first, then arrival), and when KV blocks run
            short the least important running request is preempted, also to admit a more important
            waiting one.
        budget_is_default: ``max_num_batched_tokens`` is plinth's own choice (``plinth serve`` on a CPU), not the
            user's: a model that needs more (room for a whole image beside the decodes, Gemma 3) may raise it.
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None
    async_scheduling: bool | None = None
    itl_target_ms: float = 0.0
    scheduling_policy: str = "fcfs"
    budget_is_default: bool = False

    def __post_init__(self) -> None:
        _check_flags(self)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                              f"got {self.scheduling_policy!r}")
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_seqs is not None and self.max_num_seqs > MAX_NUM_SEQS:
            raise ConfigError(f"max_num_seqs must be at most {MAX_NUM_SEQS}, got {self.max_num_seqs}")
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_waiting_requests", self.max_waiting_requests)
        if (isinstance(self.itl_target_ms, bool) or not isinstance(self.itl_target_ms, (int, float))
                or not 0 <= self.itl_target_ms < float("inf")):
            raise ConfigError(f"itl_target_ms must be a number of milliseconds >= 0 (0: off), "
                              f"got {self.itl_target_ms!r}")

    @property
    def budget_given(self) -> bool:
        """``max_num_batched_tokens`` is the user's (before and after the platform's defaults are filled in)."""
        return self.max_num_batched_tokens is not None and not self.budget_is_default

    @property
    def resolved(self) -> bool:
        return self.max_num_seqs is not None and self.max_num_batched_tokens is not None

    @property
    def limits(self) -> tuple[int, int]:
        """``(max_num_seqs, max_num_batched_tokens)``, the base defaults standing in for unset ones (for
        callers that size work before an engine resolved the platform's defaults)."""
        return (self.max_num_seqs if self.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS,
                self.max_num_batched_tokens if self.max_num_batched_tokens is not None
                else DEFAULT_MAX_NUM_BATCHED_TOKENS)

    def with_defaults(self, max_num_seqs: int, max_num_batched_tokens: int) -> SchedulerConfig:
        """This configuration with its unset limits filled in (a budget filled in is plinth's own choice:
        ``budget_is_default``)."""
        return dataclasses.replace(
            self,
            max_num_seqs=self.max_num_seqs if self.max_num_seqs is not None else max_num_seqs,
            max_num_batched_tokens=(self.max_num_batched_tokens if self.max_num_batched_tokens is not None
                                    else max_num_batched_tokens),
            budget_is_default=self.budget_is_default or self.max_num_batched_tokens is None)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor: str = "auto"

    def __post_init__(self) -> None:
        _check_flags(self)
        _positive("tensor_parallel_size", self.tensor_parallel_size, allow_none=False)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size, allow_none=False)
        if self.distributed_executor not in EXECUTORS:
            raise ConfigError(
                f"distributed_executor must be one of {', '.join(EXECUTORS)}, got {self.distributed_executor!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """Where and how to run.

    Attributes:
        platform: force a platform by name (default: ``$PLINTH_PLATFORM`` or auto-detect).
        attention_backend: force an attention backend by name (default: selected).
        gemm_kernel: force the quantization method's GEMM kernel by name (default: selected).
        selection: ``cached`` (benchmark on a cache miss), ``benchmark`` (always), ``off``
            (highest-priority supported candidate, no timing).
        enforce_eager: never capture graphs or compile.
        enable_sleep_mode: allow ``sleep()``/``wake_up()``, which give the KV cache's (and on accelerators the
            weights') memory back while the engine is idle (:mod:`plinth.worker.sleep`).
    """

    platform: str | None = None
    attention_backend: str | None = None
    gemm_kernel: str | None = None
    selection: str = "cached"
    enforce_eager: bool = False
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        _check_flags(self)
        _check_texts(self, ("platform", "attention_backend", "gemm_kernel"))
        if self.selection not in SELECTION_MODES:
            raise ConfigError(f"selection must be one of {', '.join(SELECTION_MODES)}, got {self.selection!r}")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served next to the base model (:mod:`plinth.lora`).

    Attributes:
        enable_lora: reserve room for adapters; requests may then name one (``LoRARequest``).
        max_loras: adapters that can be in use in one step (each one's requests run in the same batches as
            every other request's); a request whose adapter finds no free slot waits for one.
        max_lora_rank: the largest adapter rank accepted (the slots are sized for it).
        max_cpu_loras: adapters kept read in host memory (least recently used dropped first); default
            ``max(max_loras, 8)``.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _check_flags(self)
        _positive("max_loras", self.max_loras, allow_none=False)
        _positive("max_lora_rank", self.max_lora_rank, allow_none=False)
        _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_lora_rank > 1024:
            raise ConfigError(f"max_lora_rank must be at most 1024, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def cpu_cache_size(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, 8)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (:mod:`plinth.core.speculative`).

    Attributes:
        speculative_method: ``ngram`` (prompt lookup: drafts copied from an earlier occurrence of the
            sequence's last tokens), ``draft_model`` (a smaller model of the same vocabulary drafts greedily:
            :mod:`plinth.core.draft_model`), or None: off.
        num_speculative_tokens: the most draft tokens a sequence carries in one step.
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes searched (largest first).
        speculative_model: the draft model (a folder, ``.gguf`` file or preset) of ``draft_model``.
    """

    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_model: str | None = None

    #: the keys of the ``speculative_config`` option, as vLLM names them -> this section's fields
    KEYS = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
            "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
            "model": "speculative_model"}

    def __post_init__(self) -> None:
        _check_flags(self)
        if self.speculative_method is None:
            if self.num_speculative_tokens:
                raise ConfigError("num_speculative_tokens needs a speculative method "
                                  f"({', '.join(SPECULATIVE_METHODS)})")
            return
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.speculative_method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens, allow_none=False)
        _positive("prompt_lookup_min", self.prompt_lookup_min, allow_none=False)
        _positive("prompt_lookup_max", self.prompt_lookup_max, allow_none=False)
        if self.num_speculative_tokens > 64:
            raise ConfigError(f"num_speculative_tokens must be at most 64, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if self.speculative_method == "draft_model":
            if not isinstance(self.speculative_model, str) or not self.speculative_model.strip():
                raise ConfigError("speculative method draft_model needs the draft model: speculative_config "
                                  "{\"model\": \"path/to/draft\", \"num_speculative_tokens\": k}")
        elif self.speculative_model is not None:
            raise ConfigError(f"speculative_config's model is the draft model of method draft_model, not of "
                              f"{self.speculative_method}")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None

    @classmethod
    def parse(cls, value: Any) -> dict[str, Any]:
        """The section's fields from a ``speculative_config`` value: a dict or JSON object text with vLLM's keys
        (``method``, ``num_speculative_tokens``, ``prompt_lookup_min``, ``prompt_lookup_max``); None: off."""
        if value is None:
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON ({exc.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"unknown speculative_config key(s) {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(cls.KEYS)}")
        if "method" not in value and "model" in value:   # vLLM's: a draft model without a method drafts with it
            value = {**value, "method": "draft_model"}
        if "method" not in value:
            raise ConfigError(f"speculative_config needs a method ({', '.join(SPECULATIVE_METHODS)})")
        fields = {cls.KEYS[k]: v for k, v in value.items()}
        lookup_max = fields.get("prompt_lookup_max")
        if "prompt_lookup_min" not in fields and isinstance(lookup_max, int) and not isinstance(lookup_max, bool) \
                and lookup_max > 0:
            fields["prompt_lookup_min"] = min(cls.prompt_lookup_min, fields["prompt_lookup_max"])
        return fields


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    device: DeviceConfig = dataclasses.field(default_factory=DeviceConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)

    _SECTIONS = ("model", "cache", "scheduler", "parallel", "device", "lora", "speculative")

    def __post_init__(self) -> None:
        _check_flags(self)
        for name in KERNEL_SWITCHES:
            env_flag(name, True)
        check_march()
        from plinth.worker.cpu_path import check_cpu_switches

        check_cpu_switches()
        if self.speculative.enabled and self.model.task != "generate":
            what = "an embedding model" if self.model.task == "embed" else "a sequence classifier"
            raise ConfigError(f"speculative decoding applies to generation; {what} (task {self.model.task}) decodes "
                              "nothing: drop speculative_config")
        if self.speculative.enabled and self.model.enable_prompt_embeds:
            raise ConfigError("speculative decoding does not take prompts given as embeddings (its drafts come from "
                              "prompt tokens or a draft model that reads tokens): drop enable_prompt_embeds or "
                              "speculative_config")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build a config from flat keyword arguments (``dtype=...``, ``block_size=...``).

        Raises:
            ConfigError: an unknown keyword (with the list of known ones) or a bad value.
        """
        sections: dict[str, dict[str, Any]] = {s: {} for s in cls._SECTIONS}
        fields = cls._option_sections()
        for key, value in kwargs.items():
            if key == "speculative_config":   # vLLM's form: one dict (or JSON text) for the section
                sections["speculative"].update(SpeculativeConfig.parse(value))
                continue
            if key in VLLM_NO_EFFECT_OPTIONS:
                logging.getLogger(__name__).info("engine option %s=%r taken and not used: %s", key, value,
                                                 VLLM_NO_EFFECT_OPTIONS[key])
                continue
            key = VLLM_OPTION_NAMES.get(key, key)
            if key not in fields:
                raise ConfigError(f"unknown engine option {key!r}; known: {', '.join(sorted(fields))}")
            sections[fields[key]][key] = value
        return cls(
            model=ModelConfig(**sections["model"]),
            cache=CacheConfig(**sections["cache"]),
            scheduler=SchedulerConfig(**sections["scheduler"]),
            parallel=ParallelConfig(**sections["parallel"]),
            device=DeviceConfig(**sections["device"]),
            lora=LoRAConfig(**sections["lora"]),
            speculative=SpeculativeConfig(**sections["speculative"]),
        )

    @classmethod
    def _option_sections(cls) -> dict[str, str]:
        """Each flat option name -> the section that holds it."""
        return {f.name: s for s in cls._SECTIONS
                for f in dataclasses.fields(cls.__dataclass_fields__[s].default_factory())}  # type: ignore[misc]

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The keyword arguments :meth:`from_kwargs` takes."""
        return frozenset(cls._option_sections()) | {"speculative_config"}

    def with_overrides(self, overrides: dict[str, Any]) -> EngineConfig:
        """Apply ``{"section.field": value}`` overrides, validating the result."""
        sections = {s: getattr(self, s) for s in self._SECTIONS}
        for dotted, value in overrides.items():
            if not isinstance(dotted, str):
                raise ConfigError(f"engine option names in a plugin override are 'section.field' strings, "
                                  f"got {dotted!r}")
            section, _, field = dotted.partition(".")
            if section not in sections or field not in {f.name for f in dataclasses.fields(sections[section])}:
                raise ConfigError(f"unknown engine option {dotted!r} in a plugin override")
            sections[section] = dataclasses.replace(sections[section], **{field: value})
        return EngineConfig(**sections)
