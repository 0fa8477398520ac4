"""The model contract: what every architecture (native, fallback or plugin) implements.

A model is built from a :class:`ModelContext`, takes one step's flat batch (``input_ids``,
``positions`` and the attention metadata) and returns hidden states; the runner picks the
rows it needs and calls :meth:`CausalLM.compute_logits`. Weights arrive as
``(checkpoint_name, tensor)`` pairs with Hugging Face checkpoint names.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionBackend, AttentionMetadata
from plinth.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from plinth.model_registry.layers.attention import Attention

#: dtypes a floating-point checkpoint tensor may have
LOADABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """Everything a model needs to build itself.

    Attributes:
        hf_config: the model's transformers configuration.
        dtype: the compute dtype of parameters and activations.
        device: where the model runs.
        attention_backend: the selected attention backend (an instance), shared by all layers.
        block_size: tokens per KV-cache block.
        quant_method: the quantization method, or ``None`` for unquantized weights.
        tp_rank: this process's tensor-parallel rank.
        tp_size: the tensor-parallel world size.
        pp_rank: this process's pipeline stage (models that support pipeline parallelism build
            only that stage's layers).
        pp_size: the number of pipeline stages.
        max_model_len: the engine's context length (``None``: the config's); RoPE scalings that depend on
            it read it (``longrope``).
    """

    hf_config: PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    attention_backend: AttentionBackend
    block_size: int
    quant_method: object | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    max_model_len: int | None = None


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (casting the dtype)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ModelLoadError(f"shape mismatch: expected {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class CausalLM(nn.Module, metaclass=abc.ABCMeta):
    """Base class of every plinth model.

    Subclasses implement :meth:`forward` and :meth:`compute_logits`. The default
    :meth:`load_weights` maps checkpoint names with :meth:`map_weight_name` (which applies
    :attr:`packed_modules_mapping`) and hands each tensor to the parameter's
    ``weight_loader(param, tensor[, shard_id])``; it then checks that every parameter (and
    every shard of a fused parameter, listed in its ``expected_shards`` attribute) was loaded.

    The loader builds a model on the meta device and allocates it on ``ctx.device`` (so
    ``__init__`` must not compute values into parameters; modules recompute derived buffers in
    an ``init_buffers()`` method). A class that must build itself differently defines a
    classmethod ``create(ctx)`` returning the ready model (the transformers fallback does).
    """

    #: checkpoint name fragment -> (parameter name fragment, shard id), e.g.
    #: ``{"q_proj": ("qkv_proj", "q"), "gate_proj": ("gate_up_proj", 0)}``
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {}

    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.ctx = ctx

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: ``[T]`` int64 token ids of the flat batch.
            positions: ``[T]`` int64 position of each token in its sequence.
            metadata: the step's attention metadata (prepared by the backend).

        Returns:
            ``[T, hidden_size]`` final hidden states (after the last norm).
        """

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to vocabulary logits.

        Args:
            hidden: ``[N, hidden_size]`` rows selected by the runner.

        Returns:
            ``[N, vocab_size]`` float32 logits.
        """

    def attention_layers(self) -> list[Attention]:
        """The model's attention layers in layer order (the runner gives each a KV cache)."""
        from plinth.model_registry.layers.attention import Attention

        return [m for m in self.modules() if isinstance(m, Attention)]

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        """Map a checkpoint tensor name to ``(parameter name, shard id)``; ``None`` skips the tensor.

        The default skips rotary ``inv_freq`` buffers and applies :attr:`packed_modules_mapping`
        (the first fragment found in ``name`` wins; its shard id is passed to the loader).
        """
        if name.endswith("rotary_emb.inv_freq"):
            return None
        for fragment, (param_fragment, shard_id) in self.packed_modules_mapping.items():
            if fragment in name:
                return name.replace(fragment, param_fragment), shard_id
        return name, None

    #: set by :func:`plinth.model_registry.weight_update.update_weights` while it loads new values into a loaded
    #: model: ``"check"`` (map names, check dtypes and shapes, write nothing) or ``"write"``; neither asks for every
    #: tensor
    weight_update: str | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors (Hugging Face names) into the parameters.

        Raises:
            ModelLoadError: an unexpected or missing tensor, a shape mismatch or an
                unsupported dtype; the message names the tensor.
        """
        update = self.weight_update
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for ckpt_name, tensor in weights:
            target = self.map_weight_name(ckpt_name)
            if target is None:
                continue
            name, shard_id = target
            param = params.get(name)
            if param is None and ckpt_name.endswith(".bias") and tensor.is_floating_point() and not tensor.any():
                # older GPTQ writers store an all-zero bias for every quantized layer, also where the
                # architecture has none: adding zeros changes nothing (a non-zero one is still refused)
                continue
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {ckpt_name!r} has no matching parameter in {type(self).__name__}"
                )
            # quantized (integer) parameters validate themselves; a float one may widen an FP8 tensor itself
            if param.is_floating_point() and not (tensor.dtype == torch.float8_e4m3fn
                                                  and getattr(param, "widens_fp8", False)):
                check_loadable_dtype(ckpt_name, tensor)
            loader = getattr(param, "weight_loader", None)
            if update == "check":
                _check_update(ckpt_name, param, tensor, loader, shard_id)
                continue
            try:
                if loader is None:
                    default_weight_loader(param, tensor)
                elif shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except ModelLoadError as exc:
                raise ModelLoadError(f"tensor {ckpt_name!r}: {exc}") from exc
            loaded.add((name, shard_id))
        if update is not None:   # new values for some parameters: the others keep theirs
            return
        missing = []
        for name, param in params.items():
            if getattr(param, "optional_in_checkpoint", False):   # its default stands where the file has none
                continue
            for shard_id in getattr(param, "expected_shards", (None,)):
                if (name, shard_id) not in loaded:
                    missing.append(self.checkpoint_name(name, shard_id))
        missing = list(dict.fromkeys(missing))   # several parameters' shards may come from one checkpoint tensor
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint is missing tensor {shown}{more}")

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        """The checkpoint tensor name that fills ``param_name`` (shard ``shard_id``); for messages."""
        for fragment, (param_fragment, sid) in self.packed_modules_mapping.items():
            if sid == shard_id and param_fragment in param_name:
                return param_name.replace(param_fragment, fragment)
        return param_name if shard_id is None else f"{param_name} (shard {shard_id!r})"


#: the module of the shared layers, whose weight loaders write only the parameter they are given (so they can run on
#: a stand-in parameter on the meta device, which checks shapes and writes nothing)
_LAYERS_MODULE = "plinth.model_registry.layers."


def _check_update(name: str, param: nn.Parameter, tensor: torch.Tensor, loader: Any, shard_id: Any) -> None:
    """A weight update's checking pass for one tensor: its shape against the parameter, through the parameter's
    loader run on a stand-in on the meta device where the loader is a shared layer's (a model's own loader may
    tell parameters apart by identity: its shapes are checked as it writes)."""
    if loader is None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r}: shape mismatch: expected {tuple(param.shape)}, "
                                 f"got {tuple(tensor.shape)}")
        return
    if not getattr(loader, "__module__", "").startswith(_LAYERS_MODULE):
        return
    stand_in = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
    stand_in.__dict__.update(param.__dict__)   # the attributes its loader reads
    try:
        if shard_id is None:
            loader(stand_in, tensor.to("meta"))
        else:
            loader(stand_in, tensor.to("meta"), shard_id)
    except ModelLoadError as exc:
        raise ModelLoadError(f"tensor {name!r}: {exc}") from exc
    except (NotImplementedError, RuntimeError):   # an operation the meta device lacks: checked as it writes
        pass


def check_loadable_dtype(name: str, tensor: torch.Tensor) -> None:
    """Refuse checkpoint tensors whose dtype is not a supported floating-point type."""
    if tensor.dtype not in LOADABLE_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in LOADABLE_DTYPES)
        raise ModelLoadError(
            f"tensor {name!r} has unsupported dtype {str(tensor.dtype).removeprefix('torch.')}; "
            f"expected one of {allowed}"
        )
