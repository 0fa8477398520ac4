"""Command-line flags shared by every command that starts an engine."""

from __future__ import annotations

import argparse
import os
from typing import Any

from plinth.config import (
    CONTENT_FORMATS,
    DTYPE_ALIASES,
    DTYPES,
    EXECUTORS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    POOLING_TYPES,
    SCHEDULING_POLICIES,
    SELECTION_MODES,
    TASKS,
    EngineConfig,
)

# flag dest -> EngineConfig.from_kwargs keyword (identical names; listed to define the mapping once)
ENGINE_KWARGS = (
    "model", "tokenizer", "dtype", "max_model_len", "load_format", "quantization", "quantize_lm_head",
    "trust_remote_code",
    "seed", "served_model_name", "chat_template", "chat_template_content_format", "generation_config",
    "override_generation_config", "hf_overrides",
    "reasoning_parser", "task", "pooling", "normalize_embeddings", "max_logprobs",
    "logits_processors", "logprobs_mode", "limit_mm_per_prompt", "allowed_local_media_path", "allowed_media_domains",
    "mm_processor_kwargs", "enable_prompt_embeds", "block_size", "num_blocks", "gpu_memory_utilization", "cpu_kv_cache_bytes", "enable_prefix_caching",
    "kv_cache_dtype", "mamba_cache_slots",
    "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "max_waiting_requests",
    "async_scheduling", "itl_target_ms", "scheduling_policy",
    "tensor_parallel_size", "pipeline_parallel_size", "distributed_executor",
    "platform", "attention_backend", "gemm_kernel", "selection", "enforce_eager", "enable_sleep_mode",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "speculative_config",
)


def add_engine_args(parser: argparse.ArgumentParser, command: str, model_positional: bool = True) -> None:
    """Add the engine flags, then let plugins add theirs (hook ``plinth_add_cli_arguments``)."""
    from plinth.plugins import get_plugin_manager

    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="model directory, .gguf file, or preset (with --load-format dummy); "
                                 "default: SmolLM2-135M-Instruct")
    g = parser.add_argument_group("model")
    if model_positional:   # vLLM's spelling too (a positional must come before the other flags)
        g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the model, as the positional argument (either one, anywhere among the flags)")
    g.add_argument("--tokenizer", default=None, help="a tokenizer directory or .gguf file (default: the model's own)")
    g.add_argument("--dtype", default="auto", choices=DTYPES + tuple(DTYPE_ALIASES),
                   help="compute dtype (default auto: the checkpoint's where the platform runs it well, else the "
                        "platform's preferred one, e.g. float32 on CPUs without bfloat16)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence, prompt plus output, in tokens (default: the model's: "
                        "max_position_embeddings, times a linear/dynamic/YaRN RoPE scaling factor)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="default auto: by the path (a .gguf file or a safetensors folder); dummy: random weights")
    pm = get_plugin_manager()
    # bitsandbytes checkpoints are read by the loader (plinth.quantization.bitsandbytes), not by a plugin
    quant_names = sorted({*pm.registrations("quantization_methods"), "bitsandbytes"})
    g.add_argument("--quantization", "-q", default=None, choices=quant_names,
                   help="quantization method (plugins add names; bitsandbytes: a bitsandbytes checkpoint as stored)")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the LM head too (methods that quantize float weights: int4, fp8)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run code shipped with a checkpoint (off by default: such code never runs)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of random (dummy) weights and of requests that give none (default 0)")
    g.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="the model's name in the API (several: the first is reported, all are accepted)")
    g.add_argument("--chat-template", default=None, help="jinja2 template text or a file holding one")
    g.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="how the template sees a message's text: 'string' (text parts joined by line breaks), 'openai' "
                        "(a list of {'type': 'text', 'text'} parts), 'auto' (parts for templates that loop over "
                        "content; the default)")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling settings: 'auto' (the model folder's generation_config.json; the default), 'none' "
                        "('vllm'), or a folder or JSON file holding them")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="the model's thinking markers (qwen3, deepseek_r1, gpt_oss, or one a plugin adds): structured "
                        "outputs start after the thinking; chat replies carry it as reasoning_content")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most log-probabilities a request may ask for per position (logprobs, prompt_logprobs; "
                        "default: %(default)s)")
    g.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="what logprobs report: the model's log-probabilities (raw_logprobs, the default), those of the "
                        "distribution each token was drawn from, after the sampling parameters (processed_logprobs), "
                        "or the same as logits (raw_logits, processed_logits)")
    g.add_argument("--logits-processors", nargs="+", default=(), metavar="PROCESSOR",
                   help="custom logits processors, in the order they run: names plugins register "
                        f"({', '.join(sorted(pm.registrations('logits_processors'))) or 'none registered'}) or "
                        "'package.module:Class' references (see the README's 'Custom logits processors')")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='the most images a prompt of an image-and-text model may carry, e.g. \'{"image": 4}\' '
                        "(default 16)")
    g.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help="settings of the image processor, e.g. '{\"max_pixels\": 1003520}' for Qwen2-VL (the most "
                        "pixels an image is resized to, which bounds the positions it fills)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let image URLs name files under DIR (file:///DIR/...); default: no file URLs")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="fetch http(s) image URLs from these hosts and their subdomains ('*': any host); default: "
                        "none, images come inline as data: URLs")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="take prompts given as embeddings (prompt_embeds in /v1/completions and LLM.generate), "
                        "[positions, hidden_size] as the model's input embedding layer gives them")
    g.add_argument("--task", default="generate", choices=TASKS,
                   help="generate text, serve an embedding model (embed: /v1/embeddings, LLM.embed) or a sequence "
                        "or token classifier (classify: /classify, LLM.classify; /pooling and LLM.encode for both)")
    g.add_argument("--pooling", default=None, choices=POOLING_TYPES,
                   help="an embedding model's pooling (default: its sentence-transformers configuration, else last)")
    g.add_argument("--normalize-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalize embeddings (default: as the model's configuration says, else yes)")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="config.json keys set on top before the model is built, e.g. "
                        "'{\"max_position_embeddings\": 65536}'")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="generation-config keys set on top, e.g. '{\"temperature\": 0.5}' (temperature, top_p, "
                        "top_k, min_p, repetition_penalty, max_new_tokens)")
    g = parser.add_argument_group("cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks (default: as many as --gpu-memory-utilization or --cpu-kv-cache-bytes allow)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the fraction of an accelerator's memory plinth may use: weights, activations and KV cache "
                        "(default 0.9)")
    g.add_argument("--cpu-kv-cache-bytes", type=int, default=2 << 30,
                   help="KV-cache bytes on the CPU platform (default 2 GiB)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of earlier prompts' shared prefixes")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="on by default (accepted as vLLM's flag)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: keys and values in 8 bits (twice the "
                        "tokens per GiB), with backends that read them (Triton on GPUs with FP8, the torch backends); "
                        "bfloat16: a float32 model's keys and values in 16 bits (CPUs: half the bytes each decode "
                        "step reads)")
    g.add_argument("--mamba-cache-slots", type=int, default=None,
                   help="models with Mamba layers: states the prefix cache keeps, one sequence's size each (default: "
                        "--max-num-seqs, fewer if they do not fit half the free memory; 0: no prefix cache)")
    g = parser.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests running at once (default: the platform's, 512 on GPUs of 70 GiB and more, else 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens computed per step, decodes plus prefill chunks (default: the platform's, 2048; "
                        "plinth serve on a CPU: 256, or --max-num-seqs if more)")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="compute each prompt in one step rather than in chunks within --max-num-batched-tokens")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests queued beyond the running batch's free places before new ones are refused (the server answers 503; generate, run-batch and bench wait for room; default: no limit, except for generate "
                        "--input: 512, --max-num-seqs or the largest row's n, whichever is largest)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs on the device (default: on for accelerators, in-process "
                        "or with tensor-parallel worker processes; off on CPUs)")
    g.add_argument("--itl-target-ms", type=float, default=0.0,
                   help="while sequences decode, prefill only the prompt tokens predicted to keep each step within "
                        "this many ms (synchronous steps; default 0: off)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs: first come, first served; priority: requests' priority (lower first) orders "
                        "admission and preemption")
    g = parser.add_argument_group("parallel")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices each layer is split over (default 1)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="stages the layers are split into (default 1)")
    g.add_argument("--distributed-executor", default="auto", choices=EXECUTORS,
                   help="how ranks run: uniproc (in this process), mp (a process per rank), ray (actors); default "
                        "auto: uniproc for one rank, mp on one machine, ray with $RAY_ADDRESS or too few local GPUs")
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters next to the base model (requests name one)")
    g.add_argument("--max-loras", type=int, default=1, help="adapters in use at once (device slots; default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory (default: max(--max-loras, 8))")
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (draft '
                        'tokens copied from earlier in their context) or \'{"model": "path/to/draft", '
                        '"num_speculative_tokens": 4}\' (a smaller model of the same vocabulary drafts): decodes '
                        "carry draft tokens, verified in the same step")
    g = parser.add_argument_group("device")
    g.add_argument("--platform", default=None, help="force a platform (default: $PLINTH_PLATFORM or auto)")
    g.add_argument("--attention-backend", default=None, help="force an attention backend")
    g.add_argument("--gemm-kernel", default=None, help="force the quantization method's GEMM kernel")
    g.add_argument("--selection", default="cached", choices=SELECTION_MODES,
                   help="choosing backends and kernels: cached (benchmark the candidates once per machine and "
                        "shape, default), benchmark (every start), off (the highest-priority one, no timing)")
    g.add_argument("--enforce-eager", action="store_true", help="no graph capture or compilation")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="allow sleep and wake-up, which free the KV cache's (and on accelerators the weights') "
                        "memory while the engine is idle; plinth serve adds POST /sleep, POST /wake_up, "
                        "GET /is_sleeping")
    pm.add_cli_arguments(parser, command)


def reconcile_model(args: argparse.Namespace) -> None:
    """``--model`` into ``args.model`` (the positional); an empty name, or both naming different models, is an
    error (``./m`` and ``m`` are one model)."""
    from plinth.config import ConfigError

    flag, positional = getattr(args, "model_flag", None), getattr(args, "model", None)
    if "" in (flag, positional):
        raise ConfigError("the model name is empty (give a model directory, .gguf file or preset, or leave it out "
                          "for the default model)")
    if flag is None:
        return
    if positional is not None and os.path.normpath(positional) != os.path.normpath(flag):
        raise ConfigError(f"two models given: {positional!r} (positional) and --model {flag!r}")
    args.model = flag


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_KWARGS if hasattr(args, k)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the config from parsed flags and apply plugin overrides."""
    from plinth.plugins import get_plugin_manager

    names = getattr(args, "served_model_name", None)
    if isinstance(names, list) and len(names) > 1 and getattr(args, "model", "given") is None:
        from plinth.config import ConfigError

        raise ConfigError(f"--served-model-name took {len(names)} names ({', '.join(names)}) and no model was given: "
                          f"put the model before --served-model-name (a model path after it is read as a name)")
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    return get_plugin_manager().apply_engine_config_overrides(config, vars(args))
