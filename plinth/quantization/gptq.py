"""``gptq``: GPTQ checkpoints (AutoGPTQ / GPTQModel layout), 4-bit and 8-bit, with act order.

Per linear layer with ``K`` input and ``N`` output features, ``p = 32 / bits`` codes per word and
group size ``g``:

- ``qweight`` int32 ``[K / p, N]``: ``p`` consecutive input features per word, input ``p j + i`` in
  bits ``bits * i ..``;
- ``qzeros`` int32 ``[K / g, N / p]``: zero points packed along the output axis the same way. Version 1
  checkpoints (``checkpoint_format`` ``"gptq"``, the default) store ``zero - 1``, a historical offset
  that is added back; ``"gptq_v2"`` stores the zero point itself;
- ``scales`` float16 ``[K / g, N]``;
- ``g_idx`` int32 ``[K]``: the group of each input feature. With ``desc_act`` (act order) the groups
  are not contiguous; plinth sorts the input features by group once and permutes the activations.
  Without it ``g_idx`` may be left out (it can only be ``k // g``).

``w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.quantization.awq import (
    config_bits,
    config_flag,
    group_params,
    name_in,
    parse_group_size,
    skip_list,
)
from plinth.quantization.formats import IntWeights
from plinth.quantization.int_method import IntWeightMethod
from plinth.quantization.interface import QuantContext
from plinth.quantization.packing import unpack_int32
from plinth.quantization.params import PackedLayout, input_range, packed_parameter

FORMATS = ("gptq", "gptq_v2")


def sort_by_group(q: torch.Tensor, g_idx: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reorder ``q`` ``[N, K]`` so that groups are contiguous; returns (codes, perm or None).

    Raises:
        ModelLoadError: ``g_idx`` does not put exactly ``group`` input features in every group.
    """
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    contiguous = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx, contiguous):
        return q, None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise ModelLoadError(f"g_idx does not assign {group} input features to each of {k // group} groups")
    return q[:, perm].contiguous(), perm


#: the ``dynamic`` override keys that change how a module's tensors are stored (others, such as ``damp_percent``,
#: only steered the quantization)
_STORAGE_KEYS = ("bits", "group_size", "desc_act", "sym")


def _dynamic_rules(dynamic: Any, base: dict[str, Any]) -> tuple[tuple[re.Pattern[str], bool], ...]:
    """GPTQModel's ``dynamic``, as ``(pattern, skip)`` rules tried in order on a module's name (``re.match``; the
    first that matches decides, as GPTQModel and vLLM do): ``-:regex`` leaves the module unquantized, ``+:regex``
    or ``regex`` quantizes it, with overrides that may only repeat the checkpoint's storage settings.

    Raises:
        ConfigError: not a mapping, a bad regex, or an override of bits, group size, act order or symmetry,
            which plinth does not load."""
    if not dynamic:
        return ()
    if not isinstance(dynamic, dict):
        raise ConfigError(f"gptq: 'dynamic' must map module-name patterns to settings, got {type(dynamic).__name__}")
    rules = []
    for key, overrides in dynamic.items():
        pattern = key[2:] if isinstance(key, str) and key[:2] in ("-:", "+:") else key
        try:
            compiled = re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"gptq: 'dynamic' key {key!r} is not a regular expression ({exc})") from None
        skip = isinstance(key, str) and key.startswith("-:")
        if not skip:
            changed = {k: v for k, v in overrides.items() if k in _STORAGE_KEYS and base[k] != v} \
                if isinstance(overrides, dict) else overrides
            if changed:
                raise ConfigError(f"gptq: 'dynamic' overrides for {key!r} ({changed}) are not supported; only "
                                  f"'-:' patterns (modules left unquantized) and the checkpoint's own settings are")
        rules.append((compiled, skip))
    return tuple(rules)


def _block_modules(modules: Any) -> tuple[str, ...] | None:
    """``modules_in_block_to_quantize`` (lists of module names within a decoder block), flattened."""
    if modules is None:
        return None
    flat = [m for group in modules for m in (group if isinstance(group, list) else [group])] \
        if isinstance(modules, list) else None
    if flat is None or not flat or not all(isinstance(m, str) and m for m in flat):
        raise ConfigError(f"gptq: 'modules_in_block_to_quantize' must be lists of module names, got {modules!r}")
    return tuple(flat)


class GPTQMethod(IntWeightMethod):
    """GPTQ 4-bit (W4A16 kernels) and 8-bit (dequantize kernel)."""

    name = "gptq"

    def __init__(self, ctx: QuantContext, *, bits: int, group_size: int | None, desc_act: bool, symmetric: bool,
                 zero_offset: int, skip: tuple[str, ...] = (),
                 dynamic_rules: tuple[tuple[re.Pattern[str], bool], ...] = (),
                 block_modules: tuple[str, ...] | None = None):
        super().__init__(ctx, bits=bits, group_size=group_size, symmetric=symmetric, act_order=desc_act)
        self.zero_offset = zero_offset
        self.skip = skip
        #: GPTQModel's ``dynamic``: ``(pattern, skip)``, the first rule matching a module's name decides
        self.dynamic_rules = dynamic_rules
        #: ``modules_in_block_to_quantize`` (transformers/optimum), flattened: the only modules of a block quantized
        self.block_modules = block_modules

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> GPTQMethod:
        if quant_config is None:
            raise ConfigError("gptq reads GPTQ checkpoints; it cannot quantize float weights")
        bits = config_bits(quant_config, ("bits",), (4, 8), "gptq")
        fmt = str(quant_config.get("checkpoint_format", "gptq")).lower()
        if fmt not in FORMATS:
            raise ConfigError(f"gptq: checkpoint_format {fmt!r} is not supported ({', '.join(FORMATS)})")
        if config_flag(quant_config, "lm_head", False, "gptq"):
            raise ConfigError("gptq: checkpoints with a quantized lm_head are not supported")
        group = parse_group_size(quant_config.get("group_size", 128), "gptq")
        desc_act = config_flag(quant_config, "desc_act", False, "gptq")
        if desc_act and group is not None and ctx.tp_size > 1:
            raise ConfigError("gptq: act-order (desc_act) checkpoints with groups run with tensor-parallel size 1 "
                              "only")
        symmetric = config_flag(quant_config, "sym", True, "gptq")
        return cls(ctx, bits=bits, group_size=group, desc_act=desc_act and group is not None, symmetric=symmetric,
                   zero_offset=1 if fmt == "gptq" else 0, skip=skip_list(quant_config, "gptq"),
                   dynamic_rules=_dynamic_rules(quant_config.get("dynamic"), {
                       "bits": bits, "group_size": quant_config.get("group_size", 128), "desc_act": desc_act,
                       "sym": symmetric}),
                   block_modules=_block_modules(quant_config.get("modules_in_block_to_quantize")))

    def applies_to(self, name: str) -> bool:
        if name_in(name, self.skip) or next((skip for p, skip in self.dynamic_rules if p.match(name)), False):
            return False
        return self.block_modules is None or any(name.endswith(f".{m}") for m in self.block_modules)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        per_word = 32 // self.bits
        n = sum(output_sizes)
        if input_size % per_word or any(size % per_word for size in output_sizes):
            raise ModelLoadError(f"gptq packs {per_word} codes per word; sizes K={input_size}, N={output_sizes} "
                                 f"per rank are not multiples of {per_word}")
        packed_parameter(layer, "qweight", (input_size // per_word, n), torch.int32,
                         PackedLayout(in_dim=0, in_per_elem=per_word, out_dim=1))
        group_params(layer, input_size, n, self.group_size, per_word, zeros_packed=True)
        g_idx = packed_parameter(layer, "g_idx", (input_size,), torch.int32,
                                 PackedLayout(in_dim=0, same_for_all_shards=True))
        # without act order g_idx can only be k // g: AutoGPTQ and GPTQModel may leave it out
        g_idx.optional_in_checkpoint = not self.act_order  # type: ignore[attr-defined]

    def convert_weights(self, layer: nn.Module) -> IntWeights:
        mask = (1 << self.bits) - 1
        q = unpack_int32(layer.qweight.data, self.bits, dim=0).t().contiguous()             # [N, K]
        stored = unpack_int32(layer.qzeros.data, self.bits, dim=1).to(torch.int32)           # [G, N]
        zeros = ((stored + self.zero_offset) & mask).t().to(torch.float32).contiguous()      # [N, G]
        scales = layer.scales.data.t().to(torch.float32).contiguous()
        group = self.group_for(q.shape[1])
        perm = None
        if self.group_size is not None and getattr(layer.g_idx, "loaded_once", False):   # (else groups in order)
            start, _size, _total = input_range(layer)  # a row-parallel rank's groups start at start / g
            q, perm = sort_by_group(q, layer.g_idx.data.to(torch.int64) - start // group, group)
        return IntWeights(q, scales, zeros, self.bits, group, perm=perm, symmetric=self.symmetric)
