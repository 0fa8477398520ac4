"""The CPU fast path, set up by the CPU platform once the model and its KV cache exist.

The parts, each with a switch (environment variables, read at start-up):

- ``PLINTH_CPU_PACKED`` (default on): every unquantized linear layer and the LM head multiply with
  oneDNN-prepacked weights (:mod:`plinth.worker.cpu_linear`): bfloat16 models (bit-identical to
  ``F.linear``), and float32 models on x86-64 CPUs without native bfloat16 (the same sums in oneDNN's order: within
  float32 rounding of ``F.linear``, and about twice as fast for the LM head there).
- ``PLINTH_CPU_INT4`` (default on for a bfloat16 model read from a GGUF file, and for a float32 one on a
  CPU without native bfloat16, whose decode rows then take the native float32 GEMV): layers whose GGUF
  tensors are ``Q4_0``/``Q4_1`` also get the file's 4-bit blocks for inputs of at most
  ``PLINTH_CPU_INT4_MAX_ROWS`` rows (default 4: decode of a few sequences), where a step is bound by
  reading the weights (:mod:`plinth.worker.cpu_int4`).
- ``PLINTH_CPU_Q4_PANEL_MAX_ROWS`` (default 64; at most ``PLINTH_CPU_INT4_MAX_ROWS`` turns it off): inputs of
  more rows than the int4 switch-over and at most this many (decode batches) multiply the same 4-bit copies
  with the native panel GEMM (AVX512-BF16: the 4-bit codes expanded to bfloat16 per thread, then bfloat16
  dot products), which reads a quarter of the bytes of the prepacked bfloat16 weights: decode steps of 8 / 32
  sequences 19.6 / 45.2 ms against 24.5 / 51.8 ms; a 500-token prefill is compute-bound and no faster. On CPUs with
  AMX-BF16 the panel GEMM runs on AMX tiles and the default is every row count past the GEMV's 8 (prefill too: faster
  than oneDNN's bfloat16 GEMM there); ``PLINTH_CPU_AMX=0`` turns the AMX kernels off.
- ``PLINTH_CPU_Q8_HEAD_MAX_ROWS`` (default 4; 0 turns it off): when the GGUF file stores the LM head
  (or the tied embedding) as ``Q8_0``, inputs of at most this many rows multiply those blocks with the
  native GEMV (:mod:`plinth.kernels.cpu_native`): half the bytes of bfloat16, and the file's values. float32
  models on AVX2 also multiply 5-20 float32 rows (any step) with a regrouped copy of the blocks, in float32.
- ``PLINTH_CPU_INT8_ACT`` (bfloat16 models: default off): layers with the file's 4-bit blocks, for inputs of
  more than ``PLINTH_CPU_INT4_MAX_ROWS`` rows (decode batches and prefill), and a ``Q8_0`` LM head, for more
  than ``PLINTH_CPU_Q8_HEAD_MAX_ROWS`` rows, multiply the file's codes with the inputs quantized to int8 per
  row and 32 features (GGUF's own activation format, as llama.cpp computes): integer dot products per block
  (AVX512-VNNI), twice the multiply rate of bfloat16, so batched decode and prefill GEMMs run ~1.4x faster.
  Outputs differ from the bfloat16 reference by the 8-bit rounding of the inputs (~0.5% of a product), so
  it is a switch, not the default. Float32 GGUF models (CPUs without native bfloat16): default on; in decode
  steps (any batch size) their 4-bit layers multiply with 8-bit inputs (AVX2 ``vpmaddubsw``, 1.4-3.4x the
  float32 GEMV and GEMM there at 1-32 rows; prompts keep float32) and a ``Q8_0`` head's 1-3 rows with two 8-bit planes
  (~15 bits); ``0`` turns it off. ``all``: prompts and mixed steps too (a 500-token prompt ~1.5x faster, at the
  price of the inputs' 8-bit rounding in the prompt's KV cache).
- ``PLINTH_CPU_DECODE_PLAN`` (default on): decode batches of a standard bfloat16 or float32 decoder model run
  through a flat list of prepared kernel calls instead of the module tree
  (:mod:`plinth.worker.cpu_decode_plan`; the same kernels, bit-identical results, a fraction of the
  Python). Not used when decode steps are compiled; ``--enforce-eager`` runs the modules.
- ``PLINTH_CPU_COMPILE`` (default off; ``--enforce-eager`` always turns it off): decode batches of up to
  ``PLINTH_CPU_COMPILE_MAX_BATCH`` sequences (default 8) run a ``torch.compile``d forward pass per
  padded batch size, compiled on first use (:mod:`plinth.worker.cpu_graphs`). Larger batches are
  bound by the GEMMs and run eagerly. Off by default: on two cores a size takes 15-120 s to compile
  (about 13 s from a warm inductor cache) for about 15% less CPU time per batch-1 step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from typing import Any

import torch

from plinth.config import ConfigError, env_flag
from plinth.kernels import cpu_native, ops

logger = logging.getLogger(__name__)

PACKED_ENV = "PLINTH_CPU_PACKED"
INT4_ENV = "PLINTH_CPU_INT4"
INT4_ROWS_ENV = "PLINTH_CPU_INT4_MAX_ROWS"
Q8_HEAD_ROWS_ENV = "PLINTH_CPU_Q8_HEAD_MAX_ROWS"
Q4_PANEL_ROWS_ENV = "PLINTH_CPU_Q4_PANEL_MAX_ROWS"
INT8_ACT_ENV = "PLINTH_CPU_INT8_ACT"
COMPILE_ENV = "PLINTH_CPU_COMPILE"
DECODE_PLAN_ENV = "PLINTH_CPU_DECODE_PLAN"
COMPILE_BATCH_ENV = "PLINTH_CPU_COMPILE_MAX_BATCH"

DEFAULT_INT4_MAX_ROWS = 4
DEFAULT_Q8_HEAD_MAX_ROWS = 4
DEFAULT_Q4_PANEL_MAX_ROWS = 64
DEFAULT_COMPILE_MAX_BATCH = 8


def int8_act_mode(default: bool) -> str:
    """``PLINTH_CPU_INT8_ACT``: ``"off"`` (``0/false/no/off``), ``"on"`` (``1/true/yes/on``) or ``"all"``
    (float32 models: prompts too, not only decode steps); unset: ``"on"`` or ``"off"`` as ``default``.

    Raises:
        ConfigError: any other value.
    """
    raw = os.environ.get(INT8_ACT_ENV)
    if raw is not None and raw.strip().lower() == "all":
        return "all"
    try:
        return "on" if env_flag(INT8_ACT_ENV, default) else "off"
    except ConfigError:
        raise ConfigError(f"{INT8_ACT_ENV}={raw!r}: expected 1/0, true/false, yes/no, on/off or all") from None


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """A non-negative integer from the environment.

    Raises:
        ConfigError: not an integer, or below ``minimum``.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r}: must be at least {minimum}")
    return value


def check_cpu_switches() -> None:
    """Check every CPU-path variable at start-up, whichever parts of the path a model then takes (a value is
    otherwise read only by the branch that uses it, so a bad one could pass unnoticed).

    Raises:
        ConfigError: naming the variable.
    """
    for name in (PACKED_ENV, INT4_ENV, COMPILE_ENV, DECODE_PLAN_ENV):
        env_flag(name, True)
    int8_act_mode(False)
    for name in (INT4_ROWS_ENV, Q8_HEAD_ROWS_ENV, Q4_PANEL_ROWS_ENV, COMPILE_BATCH_ENV):
        env_int(name, 0)


#: the packed weight copies may use at most this fraction of the free memory
MAX_PACKED_FRACTION = 0.5


def _packed_bytes(model: torch.nn.Module, int4_copies: bool = False) -> int:
    """Bytes of the weights that would get a packed copy (linear layers and the LM head), plus about one byte
    per weight for the 4-bit copies of a GGUF model (``int4_copies``: the codes in torch's layout and in the
    native panels, and their scales)."""
    from plinth.model_registry.layers.linear import LinearBase

    total = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        head = name == "lm_head" and getattr(module, "gemm", None) is None   # not a quantized head
        if isinstance(weight, torch.Tensor) and (isinstance(module, LinearBase) or head):
            total += weight.numel() * (weight.element_size() + (1 if int4_copies else 0))
    return total


def _free_memory() -> int:
    from plinth.platforms.cpu.platform import CpuPlatform

    return CpuPlatform().free_memory()


def _float32_gguf(source: Any, dtype: torch.dtype, tp_size: int) -> bool:
    """Whether a float32 GGUF model may keep the file's blocks for decode rows (4-bit layers, a Q8_0 LM head):
    on CPUs without native bfloat16, where float32 is the default because bfloat16 GEMMs are emulated, and
    the 4-bit copies stream a decode step's weights several times faster than the float32 GEMV
    (``PLINTH_CPU_INT4=0`` turns the 4-bit copies off, ``PLINTH_CPU_Q8_HEAD_MAX_ROWS=0`` the head)."""
    from plinth.platforms.cpu import platform as cpu_platform

    return (source is not None and getattr(source, "kind", None) == "gguf" and dtype == torch.float32
            and tp_size == 1 and not cpu_platform.has_fast_bf16())


def give_back_freed_memory() -> None:
    """Return the free pages inside the C heap to the system (glibc's ``malloc_trim``): the float weights released
    once packed were freed, but those the allocator had placed in its heap stay resident until then. Elsewhere
    (another C library) nothing happens."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)


def accelerate_cpu_runner(runner: Any, source: Any, config: Any) -> dict[str, Any]:
    """Install the CPU GEMMs and the compiled decode step on ``runner``; returns what was set up."""
    from plinth.worker.cpu_linear import install_cpu_linear, packed_linear_supported

    model = runner.model
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    report: dict[str, Any] = {"packed": 0, "int4": 0, "compile": False}
    tp_size = getattr(getattr(model, "ctx", None), "tp_size", 1)
    t0 = time.perf_counter()
    native_bf16 = dtype == torch.bfloat16 and packed_linear_supported(dtype)
    pack = env_flag(PACKED_ENV, True) and packed_linear_supported(dtype)
    gguf = source is not None and getattr(source, "kind", None) == "gguf" and tp_size == 1
    int4_copies = gguf and env_flag(INT4_ENV, True)
    if pack and (extra := _packed_bytes(model, int4_copies)) > MAX_PACKED_FRACTION * (free := _free_memory()):
        logger.warning("not prepacking the CPU GEMMs: the packed copies (%.1f GiB) would take more than half of "
                       "the free memory (%.1f GiB)", extra / 2**30, free / 2**30)
        pack = False
    if native_bf16 and (pack or gguf):
        # the oneDNN-packed bfloat16 GEMMs (unless switched off or too large); for a GGUF model also the file's
        # 4-bit blocks and Q8_0 LM head, which packing being off does not turn off (their own switches do)
        int4, head_q8 = {}, None
        int4_rows = env_int(INT4_ROWS_ENV, DEFAULT_INT4_MAX_ROWS)
        q8_rows = env_int(Q8_HEAD_ROWS_ENV, DEFAULT_Q8_HEAD_MAX_ROWS)
        if gguf and int4_rows > 0 and env_flag(INT4_ENV, True):
            from plinth.worker.cpu_int4 import int4_weights_from_gguf

            int4 = int4_weights_from_gguf(str(source.path), model, dtype)
        if gguf and q8_rows > 0 and cpu_native.available(dtype):
            from plinth.worker.cpu_int4 import q8_0_lm_head_from_gguf

            head_q8 = q8_0_lm_head_from_gguf(str(source.path), model)
        # on AMX tiles the panel GEMM beats oneDNN's bfloat16 GEMM at every row count past the GEMV's
        panel_rows = env_int(Q4_PANEL_ROWS_ENV, sys.maxsize if cpu_native.q4_amx_supported()
                             else DEFAULT_Q4_PANEL_MAX_ROWS)
        int8_act = int8_act_mode(False) != "off"   # "all" is "on" here: every row count past the int4 GEMV's
        if int8_act and not cpu_native.vnni_supported():
            logger.warning("%s=1 ignored: the native kernels were not built with AVX512-VNNI and AVX512-BF16",
                           INT8_ACT_ENV)
        report.update(install_cpu_linear(model, int4, int4_rows, head_q8, q8_rows, panel_rows,
                                         int8_activations=int8_act, pack=pack))
        report["int4_max_rows"] = int4_rows if report["int4"] else 0
        report["amx"] = bool(report["int4"]) and panel_rows > int4_rows and cpu_native.q4_amx_supported()
    elif pack or _float32_gguf(source, dtype, tp_size):
        # float32 models (on CPUs without native bfloat16, where float32 is the default): the oneDNN-packed
        # float32 GEMM (unless switched off or too large); for a GGUF model's decode rows also the file's 4-bit
        # blocks, and the LM head from the file's Q8_0 blocks (a quarter of the float32 weight's bytes), both
        # taking the float32 rows as they are where the native kernels run; each can be turned off alone
        int4, head_q8, int4_rows, q8_rows = {}, None, 0, 0
        f32_gguf = _float32_gguf(source, dtype, tp_size)
        # PLINTH_CPU_INT8_ACT (default on here): the 4-bit layers' and the Q8_0 head's decode GEMVs quantize
        # their float32 rows to 8 bits per 32 features (AVX2 vpmaddubsw)
        # (one pipeline stage: stages run forward_stage, which the decode-step marking does not reach)
        mode = int8_act_mode(True)
        int8_act = (f32_gguf and mode != "off" and getattr(getattr(model, "ctx", None), "pp_size", 1) == 1)
        if f32_gguf:
            int4_rows = env_int(INT4_ROWS_ENV, DEFAULT_INT4_MAX_ROWS) if env_flag(INT4_ENV, True) else 0
            q8_rows = env_int(Q8_HEAD_ROWS_ENV, DEFAULT_Q8_HEAD_MAX_ROWS)
            if int4_rows > 0:
                from plinth.worker.cpu_int4 import int4_weights_from_gguf

                int4 = int4_weights_from_gguf(str(source.path), model, torch.bfloat16)
                if int8_act:
                    for weight in int4.values():
                        weight.take_int8_inputs()
            if q8_rows > 0 and cpu_native.q8_0_supported(torch.float32):
                from plinth.worker.cpu_int4 import q8_0_lm_head_from_gguf

                head_q8 = q8_0_lm_head_from_gguf(str(source.path), model)
        if pack or int4 or head_q8 is not None:
            report.update(install_cpu_linear(model, int4, int4_rows, head_q8, q8_rows, pack=pack,
                                             int8_activations=int8_act, int8_prompts=int8_act and mode == "all"))
            if report.get("int8"):   # layers or the head with 8-bit inputs for decode steps
                from plinth.worker.cpu_linear import mark_decode_steps

                mark_decode_steps(model, prompts=mode == "all")
                report["int8_prompts"] = mode == "all"
            report["int4_max_rows"] = int4_rows if report["int4"] else 0
    if report.get("released"):
        give_back_freed_memory()
    enforce_eager = bool(getattr(getattr(config, "device", None), "enforce_eager", False))
    max_num_seqs = config.scheduler.limits[0]
    max_batch = min(env_int(COMPILE_BATCH_ENV, DEFAULT_COMPILE_MAX_BATCH), max_num_seqs)
    encoder = getattr(model, "is_encoder", False)
    if enforce_eager:
        logger.info("CPU decode compilation off (enforce_eager)")
    elif encoder:
        logger.info("encoder-only model: no decode steps (each input runs whole in one step)")
    elif not getattr(runner.backend, "compile_safe_decode", False):
        logger.info("attention backend %s has no static-shape decode path: decode runs eagerly", runner.backend.name)
    elif getattr(model, "lora_state", None) is not None:
        logger.info("LoRA adapters enabled: decode runs the module tree (no compiled step or decode plan)")
    elif getattr(model, "has_recurrent_state", False):
        logger.info("Mamba layers keep per-sequence state: decode runs the module tree (no compiled step or decode "
                    "plan)")
    elif any(getattr(layer, "attention_chunk", None) for layer in model.attention_layers()):
        logger.info("chunked local attention: decode runs the module tree (no compiled step)")
    elif env_flag(COMPILE_ENV, False) and max_batch > 0:
        runner.compile_cpu_decode(max_batch)
        report["compile"] = True
    report["decode_plan"] = False
    if (not report["compile"] and not enforce_eager and not encoder and env_flag(DECODE_PLAN_ENV, True)
            and getattr(model, "lora_state", None) is None and not getattr(model, "has_recurrent_state", False)):
        from plinth.worker.cpu_decode_plan import build_decode_plan

        spec = getattr(config, "speculative", None)
        # with speculative decoding a sequence's drafts go as decode rows beside its token
        max_rows = max_num_seqs * (1 + spec.num_speculative_tokens if spec is not None and spec.enabled else 1)
        plan, why_not = build_decode_plan(model, runner.backend, runner.block_size, max_rows)
        if plan is None:
            logger.info("CPU decode plan off: %s", why_not)
        else:
            runner.graphs = plan
            report["decode_plan"] = True
    report["seconds"] = time.perf_counter() - t0
    logger.info("CPU path: %d layers prepacked (%d of them held packed only), %d with int4 copies (batches of <= %s rows; 4-bit panels on AMX tiles "
                "%s), LM head Q8_0 %s, %d with int8 inputs%s, native fused ops %s, decode plan %s, compiled decode %s "
                "(<= %d sequences), set up in %.2f s",
                report["packed"], report.get("released", 0), report["int4"], report.get("int4_max_rows", 0), "on" if report.get("amx") else "off",
                "on" if report.get("q8_0") else "off",
                report.get("int8", 0), " (prompts too)" if report.get("int8_prompts") else "",
                "on" if ops.fused_ops_enabled(torch.empty(0, dtype=dtype)) else "off",
                "on" if report["decode_plan"] else "off", "on" if report["compile"] else "off", max_batch,
                report["seconds"])
    return report
