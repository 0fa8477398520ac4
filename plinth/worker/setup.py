"""Engine start-up: platform, model source, dtype, tokenizer, attention backend, weights, KV cache."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from plinth.attention_backends.interface import AttentionSpec, kv_cache_torch_dtype
from plinth.config import ConfigError, EngineConfig, env_flag
from plinth.errors import ModelLoadError
from plinth.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineParts:
    platform: Any
    device: torch.device
    source: Any
    model_name: str
    tokenizer: Any
    chat_template: str | None
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    selection: Any
    runner: ModelRunner | None   # None when worker processes own the model (see executor)
    num_blocks: int
    executor: Any = None         # a plinth.distributed executor; None: the runner runs in-process
    config: EngineConfig | None = None   # the configuration with the platform's scheduler defaults filled in
    default_sampling: dict[str, Any] = dataclasses.field(default_factory=dict)   # the generation config's
    draft_runner: ModelRunner | None = None   # speculative decoding's draft model (``draft_model``)


#: lets ``max_model_len`` exceed the model's context (vLLM: ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)
LONG_MAX_MODEL_LEN_ENV = "PLINTH_ALLOW_LONG_MAX_MODEL_LEN"


def resolve_max_model_len(config: EngineConfig, hf: Any) -> int:
    """``max_model_len``, or the model's context when unset (``context_length``).

    Raises:
        ConfigError: a ``max_model_len`` above the model's context, unless ``PLINTH_ALLOW_LONG_MAX_MODEL_LEN`` is on
            (positions the model was not trained for give wrong outputs, as vLLM warns).
    """
    from plinth.model_registry.layers.rotary import context_length
    from plinth.model_registry.models.bert import position_offset

    # max_position_embeddings, times a RoPE scaling factor that extends it (less the positions that RoBERTa-style
    # encoders skip)
    limit = context_length(hf) - position_offset(hf)
    wanted = config.model.max_model_len
    if not wanted:
        return limit
    if wanted > limit:
        if not env_flag(LONG_MAX_MODEL_LEN_ENV, False):
            raise ConfigError(f"max_model_len {wanted} exceeds the model's context length {limit} "
                              "(max_position_embeddings, times a RoPE scaling factor that extends it): positions "
                              f"beyond it give wrong outputs; set {LONG_MAX_MODEL_LEN_ENV}=1 to allow it anyway")
        logger.warning("max_model_len %d exceeds the model's context length %d (allowed by %s)", wanted, limit,
                       LONG_MAX_MODEL_LEN_ENV)
    return wanted


def generation_defaults(source: Any, config: EngineConfig, tokenizer: Any) -> tuple[dict[str, Any], tuple[int, ...]]:
    """``(default sampling keywords, end-of-sequence ids)``: the model's own ids and its generation
    config's (:mod:`plinth.model_registry.generation_config`)."""
    from plinth.model_registry.generation_config import read_generation_defaults

    model = config.model
    found = read_generation_defaults(model.generation_config, dict(model.override_generation_config or ()),
                                     source.path, source.kind)
    hf_config = source.hf_config
    vocab = getattr(hf_config, "vocab_size", None)
    bad = next((t for t in found.eos_token_ids if vocab is not None and t >= vocab), None)
    if bad is not None:
        raise ModelLoadError(f"{found.origin}: eos_token_id {bad} is not below the model's vocab_size {vocab}")
    return found.sampling, tuple(dict.fromkeys(eos_ids(hf_config, tokenizer) + found.eos_token_ids))


def resolve_scheduler_limits(config: EngineConfig, platform: Any) -> EngineConfig:
    """``config`` with unset scheduler limits replaced by the platform's defaults for its device 0."""
    if config.scheduler.resolved:
        return config
    seqs, tokens = platform.scheduler_defaults(0)
    scheduler = config.scheduler.with_defaults(seqs, tokens)
    logger.info("scheduler limits: %d requests at once, %d tokens per step (%s defaults; --max-num-seqs and "
                "--max-num-batched-tokens change them)", scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                platform.name)
    return dataclasses.replace(config, scheduler=scheduler)


def decode_rows(config: EngineConfig) -> int:
    """The most step tokens one decoding sequence takes (its token and its speculative drafts)."""
    spec = config.speculative
    return 1 + (int(spec.num_speculative_tokens or 0) if spec.enabled else 0)


def _room_for_whole_images(config: EngineConfig) -> EngineConfig:
    """``config`` with plinth's own step budget raised to an image's positions beside a full batch of decodes (their
    drafts included) where the model's image positions attend to each other (Gemma 3; read from a model directory's
    config before any worker starts)."""
    from plinth.model_registry.loader import resolve_model_source

    config_file = os.path.join(os.path.expanduser(str(config.model.model)), "config.json")
    try:   # (only Gemma 3's image-and-text configs: the other models' start-up reads nothing more)
        with open(config_file, encoding="utf-8") as f:
            if json.load(f).get("model_type") != "gemma3":
                return config
    except (OSError, ValueError, AttributeError):
        return config
    try:
        whole = whole_image_positions(resolve_model_source(config.model), config)
    except Exception:   # noqa: BLE001 - the load that follows reports a bad model as it always does
        return config
    seqs, tokens = config.scheduler.limits
    need = whole + seqs * decode_rows(config)
    if not whole or tokens >= need:
        return config
    logger.info("max_num_batched_tokens %d -> %d: an image's %d positions are prefilled in one step, beside up to %d "
                "decodes", tokens, need, whole, seqs)
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=need))


#: an encoder's step budget on an accelerator where the user set none: no KV cache and no decodes to keep
#: prompt, so a step runs many inputs (the 2048-token default runs a few short ones, and the step's fixed costs
#: then dominate: bert-base on an H100 embeds 3x faster with 8192 tokens a step)
ENCODER_STEP_TOKENS = 16384


def encoder_settings(config: EngineConfig, max_model_len: int, device_type: str) -> EngineConfig:
    """``config`` for an encoder-only model, whose every position attends to its whole input: inputs run whole in
    one step (chunked prefill off, the step budget at least ``max_model_len``, and at least
    :data:`ENCODER_STEP_TOKENS` on an accelerator unless the user set the budget) and the prefix cache is off (a
    position's state depends on the tokens after it).

    Raises:
        ConfigError: speculative decoding, which needs a model that generates text.
    """
    if config.speculative.enabled:
        raise ConfigError("speculative decoding needs a model that generates text; encoder-only models embed and "
                          "classify")
    scheduler = config.scheduler
    budget = max(scheduler.max_num_batched_tokens, max_model_len)
    if not scheduler.budget_given and device_type != "cpu":
        budget = max(budget, ENCODER_STEP_TOKENS)
    if budget != scheduler.max_num_batched_tokens:
        logger.info("max_num_batched_tokens %d -> %d: an encoder's input runs whole in one step, and steps run many "
                    "inputs",
                    scheduler.max_num_batched_tokens, budget)
    if scheduler.enable_chunked_prefill or config.cache.enable_prefix_caching:
        logger.info("encoder-only model: chunked prefill and the prefix cache are off (every position attends to "
                    "its whole input)")
    return dataclasses.replace(
        config, scheduler=dataclasses.replace(scheduler, enable_chunked_prefill=False, max_num_batched_tokens=budget),
        cache=dataclasses.replace(config.cache, enable_prefix_caching=False))


def whole_image_positions(source: Any, config: EngineConfig) -> int:
    """The positions of one image whose positions attend to each other, so that a prompt chunk never ends inside it
    (Gemma 3, images not turned off by ``limit_mm_per_prompt``); 0 for other models."""
    mm = getattr(source, "mm_config", None)
    if mm is None or getattr(mm, "model_type", None) != "gemma3":
        return 0
    if (config.model.limit_mm_per_prompt or {}).get("image") == 0:
        return 0
    return int(mm.mm_tokens_per_image)


def load_tokenizer(source: Any, config: EngineConfig) -> Any:
    """The tokenizer of the model (``None`` for a dummy preset without one)."""
    path = source.tokenizer_path
    if path is None:
        return None
    if str(path).lower().endswith(".gguf"):
        from plinth.model_registry.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if not Path(path).is_dir():   # plinth reads local files only: a name would be looked up on a model hub
        what = "is not a directory" if Path(path).exists() else "does not exist"
        raise ModelLoadError(f"tokenizer {str(path)!r} {what}: give a directory holding the tokenizer's files "
                             "(tokenizer.json or tokenizer_config.json) or a .gguf file")
    from transformers import AutoTokenizer, PretrainedConfig

    options: dict[str, Any] = {}
    if type(source.hf_config) is PretrainedConfig and source.path is not None \
            and Path(path).resolve() == Path(source.path).resolve():
        # a model_type transformers does not know (a plugin's architecture): hand over the generic config already
        # read, else AutoTokenizer reads it again and warns that the checkpoint "is otherwise not supported"
        options["config"] = source.hf_config
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.model.trust_remote_code, **options)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from exc
    if getattr(tokenizer, "chat_template", None) is None:   # an image-and-text checkpoint's processor's template
        tokenizer.chat_template = _processor_chat_template(Path(path))
    return tokenizer


def _processor_chat_template(path: Path) -> str | None:
    """The chat template a checkpoint's processor keeps (``chat_template.jinja``, or ``chat_template.json``'s
    ``chat_template``: llava-hf checkpoints), ``None`` where there is none."""
    import json

    jinja, js = path / "chat_template.jinja", path / "chat_template.json"
    try:
        if jinja.is_file():
            return jinja.read_text()
        if js.is_file():
            template = json.loads(js.read_text()).get("chat_template")
            return template if isinstance(template, str) and template else None
    except (OSError, ValueError, AttributeError):
        logger.warning("%s: cannot read the processor's chat template", path)
    return None


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template`` is template text or a path to a file holding one."""
    if value is None:
        return None
    path = Path(os.path.expanduser(value))   # (not Path.expanduser: "~t.jinja", naming no user, is that file)
    if "{" not in value and path.is_file():
        try:
            return _checked_template(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"--chat-template file {value!r} cannot be read as UTF-8 text: {exc}") from None
    if "{" not in value:
        raise ModelLoadError(f"--chat-template {value!r} is neither a jinja2 template nor an existing file")
    return _checked_template(value)


def _checked_template(text: str) -> str:
    """``text`` if it compiles as the chat renderer (transformers' sandboxed jinja2, with its extensions: loop
    controls, ``{% generation %}``) compiles it."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:   # another transformers layout: the sandbox with the loop controls
        import jinja2.sandbox

        def _compile_jinja_template(source: str) -> object:
            return jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"--chat-template is not a valid jinja2 template: {exc.message} (line {exc.lineno})") from None
    return text


def eos_ids(hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (getattr(hf_config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if isinstance(src, int):
            ids.append(src)
        elif isinstance(src, (list, tuple)):
            ids.extend(int(t) for t in src)
    return tuple(dict.fromkeys(ids))


#: ``model_type`` values whose native plinth model has attention sinks (the backend must apply them)
ATTENTION_SINK_MODEL_TYPES = frozenset({"gpt_oss"})


def has_attention_sinks(hf_config: Any) -> bool:
    """Whether the model's attention has sink logits: a native model that has them, or a transformers modeling
    module of that ``model_type`` that passes sinks (``s_aux=``) to its attention function (the fallback runs
    it: Granite SWA, DeepSeek V4, ...)."""
    model_type = getattr(hf_config, "model_type", None)
    if not isinstance(model_type, str) or not model_type.isidentifier():
        return False
    return model_type in ATTENTION_SINK_MODEL_TYPES or _transformers_passes_sinks(model_type)


@functools.cache
def _transformers_passes_sinks(model_type: str) -> bool:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "models", model_type, f"modeling_{model_type}.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return "s_aux=" in f.read()
    return False


def attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto") -> AttentionSpec:
    """The model's attention shapes; ``kv_cache_dtype`` is :attr:`~plinth.config.CacheConfig.kv_cache_dtype`."""
    # a model without attention layers (Mamba-2) has no attention shapes: a nominal one-head spec, whose backend no
    # layer calls
    heads = getattr(hf_config, "num_attention_heads", None) or 1
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if getattr(hf_config, "kv_lora_rank", None) and getattr(hf_config, "qk_nope_head_dim", None):
        from plinth.model_registry.models.deepseek import MLA_MODEL_TYPES, latent_cache_shape

        if getattr(hf_config, "model_type", None) in MLA_MODEL_TYPES:   # native: a cache of latents
            kv_heads, head_size = latent_cache_shape(hf_config)
        else:   # the transformers fallback pages the expanded keys (and values padded to their width)
            kv_heads, head_size = heads, hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    from plinth.model_registry.models.decoder import config_sliding_window

    window = config_sliding_window(hf_config)
    if not getattr(hf_config, "use_sliding_window", True):
        window = None
    return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads,
                         head_size=head_size, dtype=dtype, block_size=block_size, sliding_window=window,
                         kv_cache_dtype=kv_cache_torch_dtype(kv_cache_dtype, dtype),
                         logit_soft_cap=_soft_cap(hf_config),
                         sinks=has_attention_sinks(hf_config))


def _soft_cap(hf_config: Any) -> float | None:
    """The config's attention-logit soft cap when it is a usable one (the model refuses any other value itself)."""
    from plinth.model_registry.layers.attention import usable_soft_cap

    cap = getattr(hf_config, "attn_logit_softcapping", None)
    return float(cap) if usable_soft_cap(cap) else None


def _num_blocks(config: EngineConfig, platform: Any, runner_args: dict, bytes_per_block: int,
                max_model_len: int, reserve: int = 0) -> int:
    """KV blocks that fit the budget; ``reserve`` bytes are kept back (for graphs and sampling, a draft model's
    scratch blocks)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    # Never more than every running sequence at full length could use (plus the scratch block).
    useful = config.scheduler.max_num_seqs * -(-max_model_len // cache.block_size) + 1
    if platform.device_type == "cpu":
        budget = cache.cpu_kv_cache_bytes - reserve
    else:
        device = runner_args["device"]
        index = device.index or 0
        total = platform.total_memory(index)
        used = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else total - platform.free_memory(index)
        budget = int(total * cache.gpu_memory_utilization) - used - reserve
        logger.info("KV budget: %.2f GiB of %.2f GiB (%.0f%% utilization; %.2f GiB peak of weights+activations, "
                    "%.2f GiB kept for graphs and sampling)", budget / 2**30, total / 2**30,
                    cache.gpu_memory_utilization * 100, used / 2**30, reserve / 2**30)
    # a model without attention layers (every layer a Mamba layer) keeps nothing per block: the blocks only count
    # each sequence's positions
    blocks = min(useful, budget // bytes_per_block) if bytes_per_block else useful
    if blocks < 2:
        raise ModelLoadError(f"not enough memory for the KV cache: {budget / 2**20:.0f} MiB available, "
                             f"{bytes_per_block / 2**20:.2f} MiB per block; lower --max-model-len or raise the "
                             f"memory budget")
    return int(blocks)


def build_engine_parts(config: EngineConfig, executor_factory: Any = None) -> EngineParts:
    """Everything the engine needs. ``executor_factory(config)`` (optional) builds the executor
    that runs the model in worker processes instead of the default one for the configuration."""
    from plinth.attention_backends.probe import AttentionWorkload
    from plinth.core.selection import select_attention_backend
    from plinth.distributed.executor import resolve_executor_name
    from plinth.lora.layers import enable_lora_for
    from plinth.model_registry.interface import ModelContext
    from plinth.model_registry.loader import load_model, resolve_dtype, resolve_model_source
    from plinth.platforms.selection import select_platform
    from plinth.quantization.resolve import resolve_quantization

    platform = select_platform(config.device.platform)
    budget_given = config.scheduler.budget_given
    config = resolve_scheduler_limits(config, platform)
    if not budget_given:
        config = _room_for_whole_images(config)
    executor_name = resolve_executor_name(config, platform)
    drafting = config.speculative.speculative_method == "draft_model"
    if drafting and (executor_name != "uniproc" or executor_factory is not None):
        from plinth.config import ConfigError

        raise ConfigError("speculative decoding with a draft model runs in one process: not with tensor or "
                          "pipeline parallelism or worker processes (the ngram method runs there)")
    if executor_name != "uniproc" or executor_factory is not None:
        from plinth.distributed.driver import build_distributed_parts

        return dataclasses.replace(build_distributed_parts(config, platform, executor_name, executor_factory),
                                   config=config)
    platform.set_device(0)   # the CPU platform sizes its thread pool here
    device = platform.device(0)
    source = resolve_model_source(config.model)
    source.check_task(config.model.task)
    hf = source.hf_config
    dtype = resolve_dtype(config.model, hf, platform.supported_dtypes())
    quant_method = resolve_quantization(config, source, platform, dtype, device)
    tokenizer = load_tokenizer(source, config)
    default_sampling, eos = generation_defaults(source, config, tokenizer)
    max_model_len = resolve_max_model_len(config, hf)
    spec = attention_spec(hf, dtype, config.cache.block_size, config.cache.kv_cache_dtype)
    workload = AttentionWorkload.for_engine(*config.scheduler.limits,
                                            max_model_len, hf.num_hidden_layers)
    selection = select_attention_backend(spec, platform, config.device, workload=workload)
    backend = selection.instantiate()
    ctx = ModelContext(hf_config=hf, dtype=dtype, device=device, attention_backend=backend,
                       block_size=config.cache.block_size, quant_method=quant_method, max_model_len=max_model_len)
    torch.manual_seed(config.model.seed)
    model = load_model(source, ctx, seed=config.model.seed)
    model.eval()
    images = image_features(source, model, dtype, device, config.model.seed, config.model.enable_prompt_embeds)
    enable_lora_for(model, config)
    allocate_recurrent_state(model, config, platform, device)
    bytes_per_block = ModelRunner.kv_bytes_per_block(model, backend, config.cache.block_size, spec.cache_dtype)
    draft = _load_draft(config, platform, device, dtype, hf, max_model_len, workload) if drafting else None
    if draft is not None:   # the draft's KV cache has a block for every block of the target's
        bytes_per_block += ModelRunner.kv_bytes_per_block(draft[0], draft[1], config.cache.block_size, draft[2])
    reserve = 0
    if device.type == "cuda":
        weights = torch.cuda.memory_allocated(device)
        _profile_peak(model, device, config, backend, spec.cache_dtype)
        if images is not None and images.encoder is not None:
            profile_image_encoder(images, source, config, max_model_len)
        peak = torch.cuda.max_memory_allocated(device)
        if draft is not None:   # (its profile resets the peak: the larger of the two counts)
            _profile_peak(draft[0], device, config, draft[1], draft[2])
            peak = max(peak, torch.cuda.max_memory_allocated(device))
        # Graph pools hold at most one decode batch's activations (below the profiled prefill peak);
        # sampling needs a few [max_num_seqs, vocab] float32 temporaries.
        reserve = (peak - weights) + 4 * config.scheduler.max_num_seqs * hf.vocab_size * 4
    if draft is not None:   # the draft's scratch blocks (past the target's) come out of the same budget
        from plinth.core.draft_model import scratch_blocks

        reserve += scratch_blocks(config.speculative.num_speculative_tokens, config.cache.block_size,
                                  config.scheduler.max_num_seqs) * ModelRunner.kv_bytes_per_block(
            draft[0], draft[1], config.cache.block_size, draft[2])
    num_blocks = _num_blocks(config, platform, {"device": device}, bytes_per_block, max_model_len, reserve)
    runner = ModelRunner(model, backend, device, num_blocks, config.cache.block_size, max_model_len, spec.cache_dtype)
    runner.images = images
    if getattr(model, "checks_a_first_pass", False):
        first_pass(runner)
    # speculative decoding: drafts go as decode rows (decode plans and graphs run them) where the backend allows
    runner.shared_decode_rows = config.speculative.enabled and type(backend).decode_rows_may_share_sequences
    prepare_runner = getattr(platform, "prepare_runner", None)   # a platform's own fast path (CPU)
    if prepare_runner is not None:
        prepare_runner(runner, source, config)
    if config.device.enforce_eager:
        logger.info("graph capture off (enforce_eager)")
    elif runner.graphs is not None:
        pass   # the platform set up its own decode steps
    elif getattr(model, "is_encoder", False):
        logger.info("encoder-only model: no decode steps to capture (each input runs whole in one step)")
    elif not platform.supports_graph_capture or device.type != "cuda":
        logger.info("graph capture not supported on %s: decode runs eagerly", platform.name)
    elif not getattr(backend, "graph_safe", False):
        logger.info("attention backend %s cannot be captured in a graph: decode runs eagerly", backend.name)
    elif (blocker := graph_blocker(model, device, dtype)) is not None:
        logger.info("%s cannot be captured in a graph on this device: decode runs eagerly", blocker)
    else:
        runner.capture_decode_graphs(_draft_rows(config) if runner.shared_decode_rows else config.scheduler.max_num_seqs)
    draft_runner = _draft_runner(draft, runner, platform, config, max_model_len, dtype) if draft is not None else None
    name = os.path.basename(str(source.path or config.model.model or "model")).removesuffix(".gguf")
    if config.model.model is None:
        from plinth.model_registry.default_model import DEFAULT_MODEL_NAME

        name = DEFAULT_MODEL_NAME
    return EngineParts(
        platform=platform, device=device, source=source, model_name=name, tokenizer=tokenizer,
        chat_template=read_chat_template(config.model.chat_template), dtype=dtype, max_model_len=max_model_len,
        vocab_size=hf.vocab_size, eos_token_ids=eos, selection=selection, runner=runner,
        num_blocks=num_blocks, config=config, default_sampling=default_sampling, draft_runner=draft_runner,
    )


def recurrent_state_architecture(architecture: str, hf_config: Any) -> bool:
    """Whether a model of ``architecture`` with ``hf_config`` keeps per-sequence recurrent state (Mamba layers):
    its class's ``config_has_recurrent_state(hf_config)``."""
    from plinth.model_registry.registry import ModelRegistry

    try:
        cls = ModelRegistry.resolve(architecture)
    except Exception:   # noqa: BLE001 - an architecture plinth cannot build says so where it is built
        return False
    check = getattr(cls, "config_has_recurrent_state", None)
    return bool(check(hf_config)) if check is not None else False


def allocate_recurrent_state(model: Any, config: EngineConfig, platform: Any = None,
                             device: torch.device | None = None) -> None:
    """The per-sequence state of a model with Mamba layers, for ``max_num_seqs`` sequences (before the KV cache is
    sized, so that it counts as the model's memory).

    Raises:
        ConfigError: it would take more than 90% of the device's free memory.
    """
    allocate = getattr(model, "allocate_recurrent_state", None)
    if allocate is not None:
        rows = config.scheduler.max_num_seqs
        need = model.recurrent_state_bytes(rows)
        slots = mamba_cache_slots(config)
        if need and platform is not None and device is not None:
            free = platform.free_memory(device.index or 0)
            each = model.recurrent_state_bytes(rows, 1) - need
            if need > 0.9 * free:
                from plinth.config import ConfigError

                raise ConfigError(f"the Mamba layers' state for {rows} sequences (max_num_seqs) needs "
                                  f"{need / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free: lower "
                                  f"--max-num-seqs (each sequence takes {each / 2**20:.1f} MiB)")
            if config.cache.mamba_cache_slots is None and need + slots * each > 0.5 * free:
                slots = max(0, int((0.5 * free - need) // each))
                logger.info("the prefix cache keeps %d Mamba states (as many as fit half the free memory; "
                            "--mamba-cache-slots sets the number)", slots)
            elif need + slots * each > 0.9 * free:
                from plinth.config import ConfigError

                raise ConfigError(f"--mamba-cache-slots {slots} with the state of {rows} sequences needs "
                                  f"{(need + slots * each) / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB "
                                  f"free (each takes {each / 2**20:.1f} MiB)")
        nbytes = allocate(rows, slots)
        if nbytes:
            logger.info("recurrent state (Mamba layers) for %d sequences and %d prefix-cache states: %.1f MiB",
                        rows, slots, nbytes / 2**20)


def mamba_cache_slots(config: EngineConfig) -> int:
    """The prefix cache's states of a model with Mamba layers, as configured (0: prefix cache off)."""
    cache = config.cache
    if not cache.enable_prefix_caching:
        return 0
    return config.scheduler.max_num_seqs if cache.mamba_cache_slots is None else cache.mamba_cache_slots


def profile_image_encoder(images: Any, source: Any, config: EngineConfig, max_model_len: int) -> None:
    """Run the image encoder's largest pass (its activations count in start-up's peak memory), bounded by the
    processor's largest image."""
    from plinth.multimodal.images import max_patches

    images.profile(max_model_len, max_patches(source.mm_config, source.path, config.model.mm_processor_kwargs))


def image_features(source: Any, model: Any, dtype: torch.dtype, device: torch.device, seed: int,
                   prompt_embeds: bool = False) -> Any:
    """The runner's image encoder for a checkpoint with image inputs; for a text model that takes prompts given as
    embeddings (``prompt_embeds``), what writes them over the token embeddings; else ``None``.

    Raises:
        UnsupportedModelError: the language model's forward pass cannot take embeddings.
    """
    images = getattr(source, "mm_config", None) is not None
    if not images and not prompt_embeds:
        return None
    if not getattr(model, "accepts_image_embeds", False):
        from plinth.errors import UnsupportedModelError

        what = "image inputs" if images else "prompts given as embeddings (enable_prompt_embeds)"
        raise UnsupportedModelError(f"{source.architecture} cannot take embeddings in its forward pass: {what} "
                                    "need a language model on plinth's native decoder")
    from plinth.multimodal.runner import ImageFeatures, load_image_features

    if not images:
        return ImageFeatures(None, device=device, dtype=dtype)
    return load_image_features(source, dtype, device, seed)


def _load_draft(config: EngineConfig, platform: Any, device: torch.device, dtype: torch.dtype, target_hf: Any,
                max_model_len: int, workload: Any) -> tuple[Any, Any, torch.dtype, Any]:
    """The draft model of ``draft_model`` speculation (in the target's dtype, unquantized), its attention backend
    (selected for its shapes) and its KV-cache dtype.

    Raises:
        ConfigError: a draft whose vocabulary the target's does not contain, or one that cannot generate.
    """
    from plinth.config import ConfigError
    from plinth.core.selection import select_attention_backend
    from plinth.model_registry.interface import ModelContext
    from plinth.model_registry.layers.rotary import context_length
    from plinth.model_registry.loader import list_presets, load_model, resolve_model_source

    name = config.speculative.speculative_model
    fmt = config.model.load_format
    if not os.path.exists(os.path.expanduser(str(name))) and name in list_presets():
        fmt = "dummy"   # a preset drafts with random weights of its shape (the target loads as it says)
    draft_config = dataclasses.replace(config.model, model=name, tokenizer=None, load_format=fmt,
                                       quantization=None, quantize_lm_head=False, hf_overrides=None, task="generate",
                                       pooling=None, normalize_embeddings=None)
    try:
        source = resolve_model_source(draft_config)
    except ModelLoadError as exc:
        raise ModelLoadError(f"the draft model (speculative_config's model): {exc}") from None
    source.check_task("generate")
    hf = source.hf_config
    if recurrent_state_architecture(source.architecture, hf):
        raise ConfigError(f"the draft model ({source.architecture}) has Mamba layers, whose per-sequence state a "
                          "draft model cannot keep: choose a draft model without them")
    if hf.vocab_size > target_hf.vocab_size:
        raise ConfigError(f"the draft model's vocabulary ({hf.vocab_size} tokens) is larger than the target's "
                          f"({target_hf.vocab_size}): a draft model must share the target's tokenizer")
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        raise ConfigError(f"the draft model's checkpoint is quantized ({method}): a draft model loads unquantized, "
                          "from float weights")
    spec = attention_spec(hf, dtype, config.cache.block_size, config.cache.kv_cache_dtype)
    backend = select_attention_backend(spec, platform, config.device, workload=workload).instantiate()
    ctx = ModelContext(hf_config=hf, dtype=dtype, device=device, attention_backend=backend,
                       block_size=config.cache.block_size, quant_method=None, max_model_len=max_model_len)
    model = load_model(source, ctx, seed=config.model.seed)   # (a preset drafting for itself: the same weights)
    model.eval()
    model.draft_context = context_length(hf)   # (the proposer drafts no position past it)
    model.draft_vocab = hf.vocab_size           # (the target's other token ids go in as 0)
    logger.info("draft model %s: %d layers, hidden size %d", config.speculative.speculative_model,
                hf.num_hidden_layers, hf.hidden_size)
    return model, backend, spec.cache_dtype, source


def _draft_runner(draft: tuple[Any, Any, torch.dtype, Any], target: ModelRunner, platform: Any, config: EngineConfig,
                  max_model_len: int, dtype: torch.dtype) -> ModelRunner:
    """The draft model's runner: a KV cache of the target's blocks and scratch blocks after them; the platform's
    fast paths and decode graphs as the target's."""
    from plinth.core.draft_model import scratch_blocks

    model, backend, kv_dtype, source = draft
    sched = config.scheduler
    extra = scratch_blocks(config.speculative.num_speculative_tokens, config.cache.block_size, sched.max_num_seqs)
    runner = ModelRunner(model, backend, target.device, target.num_blocks + extra, config.cache.block_size,
                         min(max_model_len, model.draft_context), kv_dtype)
    if getattr(model, "checks_a_first_pass", False):
        first_pass(runner)
    # a catch-up pass's tokens go as rows of a decode step (a sequence's rows at consecutive positions) where the
    # backend allows: then the decode plan or a replayed graph runs it
    runner.shared_decode_rows = type(backend).decode_rows_may_share_sequences
    prepare_runner = getattr(platform, "prepare_runner", None)
    if prepare_runner is not None:
        prepare_runner(runner, source, config)
    if (runner.graphs is None and target.graphs is not None and target.device.type == "cuda"
            and getattr(backend, "graph_safe", False) and graph_blocker(model, target.device, dtype) is None):
        runner.capture_decode_graphs(_draft_rows(config))
    return runner


def _draft_rows(config: EngineConfig) -> int:
    """Rows of the largest decode graph with speculation: room for draft rows beside full decodes (at most 512)."""
    n = config.scheduler.max_num_seqs
    return max(n, min(n * (1 + config.speculative.num_speculative_tokens), 512))


def graph_blocker(model: Any, device: torch.device, dtype: torch.dtype) -> str | None:
    """The first module of ``model`` that says it cannot be captured in a device graph
    (``graph_capturable(device, dtype)`` False, e.g. mixture-of-experts layers without grouped GEMMs), or ``None``."""
    for name, module in model.named_modules():
        check = getattr(module, "graph_capturable", None)
        if callable(check) and not check(device, dtype):
            return f"{type(module).__name__} ({name})"
    return None


@torch.inference_mode()
def first_pass(runner: ModelRunner) -> None:
    """A two-token prefill into the last block (not yet handed to any sequence) for a model that refuses what it
    can only see running (the transformers fallback: attention computed outside the paged layers): the error comes
    at start-up, not with the first request."""
    from plinth.worker.model_runner import SeqBatchEntry

    runner.execute([SeqBatchEntry([0, 0], 0, [runner.num_blocks - 1], True)])


@torch.inference_mode()
def _profile_peak(model: Any, device: torch.device, config: EngineConfig, backend: Any,
                  kv_dtype: torch.dtype) -> None:
    """Run a forward at the maximum batched tokens so the peak activation memory is known."""
    if device.type != "cuda":
        return
    runner = ModelRunner(model, backend, device, 2, config.cache.block_size, config.cache.block_size, kv_dtype)
    from plinth.lora.layers import products_forced
    from plinth.worker.model_runner import SeqBatchEntry

    n = config.scheduler.max_num_batched_tokens
    bs = config.cache.block_size
    per_seq = bs  # one block per dummy sequence keeps the KV cache at 2 blocks
    entries = [SeqBatchEntry([0] * min(per_seq, n - i), 0, [1], True) for i in range(0, n, per_seq)]
    torch.cuda.reset_peak_memory_stats(device)
    with products_forced(model):
        runner.execute(entries)
    torch.cuda.synchronize(device)
    for layer in model.attention_layers():
        layer.kv_cache = None
    del runner
