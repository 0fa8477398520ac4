"""Embeddings and classification: a prompt's final hidden states pooled into one vector (``task="embed"``), or
a sequence classifier's label probabilities (``task="classify"``).

An engine started with ``task="embed"`` serves embedding models (decoder models trained for retrieval, such as
Qwen3-Embedding or e5-mistral): a request is its prompt's prefill, whose final-norm hidden states are pooled

- ``last``: the last token's (the usual choice of decoder embedding models),
- ``mean``: the average over the prompt's tokens,
- ``cls``: the first token's,

then L2-normalized (unless turned off). The pooling comes from the model folder's sentence-transformers files
(``modules.json`` naming a ``Pooling`` module and its ``config.json``, a ``Normalize`` module) when it has them,
else ``last`` with normalization; ``pooling=`` and ``normalize_embeddings=`` override. A request may ask for
fewer ``dimensions`` (the first ones, normalized again: models trained with Matryoshka loss keep most of
their quality) and turn normalization off.

The prefill runs as the engine's other prompts do (chunked, batched with other requests, preemptible); mean
and ``cls`` pooling need every position's hidden state, so an embedding engine with them computes prompts
without the prefix cache.

A sequence classifier (``LlamaForSequenceClassification``, ``Qwen3ForSequenceClassification`` and the like: reward
models, cross-encoder rerankers, text classifiers) pools the final-norm hidden state of the last token that is not
the pad token, as transformers' classes do, and its ``score`` layer maps it to one logit per label; the probabilities follow transformers'
text-classification rule (:class:`ClassifierHead`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from plinth.errors import ModelLoadError

#: prompt text of a request with ``truncate_prompt_tokens`` may exceed the context (its tokens are cut to the last
#: N): it is tokenized whole up to this many characters (~16 MiB of text, a few seconds of tokenizing)
MAX_TRUNCATED_CHARS = 1 << 24

#: what a pooling request asks for (vLLM's pooling tasks): one vector (``embed``) or one set of label probabilities
#: (``classify``) for the prompt, or one for each prompt token (``token_embed``, ``token_classify``)
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")

_ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_cls_token": "cls"}


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options.

    Attributes:
        normalize: L2-normalize the vector (``None``: the engine's setting).
        dimensions: keep the first ``dimensions`` components (then normalize, where normalizing).
        truncate_prompt_tokens: embed only the input's last N tokens (-1: as many as the context holds).
        use_activation: vLLM's switch of the output's activation: a classifier's probabilities (``None`` or
            true: its softmax or sigmoid) or its raw logits (false); for embeddings, their normalization (as
            ``normalize``, which wins where both are given).
        activation: the older name of ``use_activation`` (vLLM's, deprecated there).
        task: one of :data:`POOLING_TASKS` (``None``: the engine's own: ``embed``, ``classify``, or a token
            classifier's ``token_classify``); ``LLM.encode`` sets it from its ``pooling_task``.
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        from plinth.core.request import truncation_problem

        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

        problem = truncation_problem(self.truncate_prompt_tokens)
        if problem is not None:
            raise ValueError(f"truncate_prompt_tokens {problem}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        for name in ("use_activation", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.activation is not None:
            if self.use_activation is not None and self.use_activation != self.activation:
                raise ValueError("use_activation and activation (its older name) disagree: give one")
            object.__setattr__(self, "use_activation", self.activation)
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How an embedding engine pools: ``kind`` (one of ``plinth.config.POOLING_TYPES``), ``normalize``, and where
    that came from."""

    kind: str = "last"
    normalize: bool = True
    origin: str = "the default"


def resolve_pooling(model_path: str | None, pooling: str | None, normalize: bool | None,
                    default: str = "last") -> PoolingConfig:
    """The pooling of an embedding model: the flags where given, else the model folder's sentence-transformers
    configuration, else ``default`` (``last``; an encoder's ``cls``) with normalization.

    Raises:
        ModelLoadError: sentence-transformers modules plinth cannot run (a ``Dense`` projection, a pooling mode
            other than last/mean/cls).
    """
    found = _sentence_transformers(Path(model_path)) if model_path and Path(model_path).is_dir() else None
    kind, norm, origin = default, True, "the default"
    if found is not None:
        kind, norm, origin = found
    if pooling is not None or normalize is not None:
        origin = "the engine's options" if found is None else f"{origin} and the engine's options"
    return PoolingConfig(pooling or kind, norm if normalize is None else normalize, origin)


def _sentence_transformers(folder: Path) -> tuple[str, bool, str] | None:
    """``(pooling, normalize, origin)`` from ``modules.json`` and the pooling module's config, or ``None``."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        kinds = [str(m.get("type", "")) for m in modules]
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {modules_file}: {exc}") from None
    unsupported = [k for k in kinds if k.rsplit(".", 1)[-1] not in ("Transformer", "Pooling", "Normalize")]
    if unsupported:
        raise ModelLoadError(f"{modules_file}: plinth runs the Transformer, Pooling and Normalize modules only, "
                             f"not {', '.join(unsupported)}")
    kind = "last"
    pooling_module = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling_module is not None:
        config_file = folder / str(pooling_module.get("path", "")) / "config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read the pooling configuration {config_file}: {exc}") from None
        modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
        if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
            raise ModelLoadError(f"{config_file}: plinth pools by last token, mean or CLS token, one at a time; "
                                 f"this asks for {', '.join(modes) or 'none'}")
        kind = _ST_POOLING_MODES[modes[0]]
    return kind, any(k.endswith(".Normalize") for k in kinds), str(modules_file)


class PoolState:
    """What an embedding request has gathered of its prompt's hidden states (float64 on the host; each position's
    as float32 for ``kind`` ``all``: a per-token task, or as ``reduce`` makes it), and its options."""

    def __init__(self, kind: str, num_prompt: int, params: PoolingParams,
                 reduce: Callable[[np.ndarray], np.ndarray] | None = None):
        self.kind = kind
        self.num_prompt = num_prompt
        self.params = params
        #: ``all``: what each row is kept as (a token classifier's logits: ``[n, labels]``, not ``[n, hidden]``)
        self.reduce = reduce
        self.covered = 0            # positions added to ``total`` (a preempted prefill starts again at 0)
        self.total: np.ndarray | None = None
        self.parts: list[np.ndarray] = []   # ``all``: the positions' rows so far, in order
        self.vector: np.ndarray | None = None   # the pooled vector (``all``: the [positions, hidden] matrix)

    def rows_wanted(self, start: int, num_new: int) -> tuple[int, int] | None:
        """The positions ``[a, b)`` of the chunk ``[start, start + num_new)`` whose hidden states are needed."""
        end = min(start + num_new, self.num_prompt)
        if self.kind == "last":
            return (self.num_prompt - 1, self.num_prompt) if start < self.num_prompt <= end else None
        if self.kind == "cls":
            return (0, 1) if start == 0 and end > 0 and self.vector is None else None
        first = max(start, self.covered)
        return (first, end) if end > first else None

    def add(self, first: int, rows: np.ndarray) -> None:
        """Hidden states ``[n, hidden]`` of positions ``first ..`` (those before ``covered``, added already by an
        earlier step, are skipped: a prefill preempted and recomputed while a step was in flight)."""
        if self.kind in ("mean", "all") and first < self.covered:
            rows, first = rows[self.covered - first:], self.covered
            if not len(rows):
                return
        if self.kind == "all":
            self.parts.append(self.reduce(rows) if self.reduce is not None else np.array(rows, dtype=np.float32))
            self.covered = first + len(rows)
            if self.covered >= self.num_prompt:
                self.vector = np.concatenate(self.parts)
                self.parts = []
            return
        rows = rows.astype(np.float64)
        if self.kind == "mean":
            self.total = rows.sum(axis=0) if self.total is None else self.total + rows.sum(axis=0)
            self.covered = first + len(rows)
            if self.covered >= self.num_prompt:
                self.vector = self.total / self.num_prompt
        else:
            self.vector = rows[-1]


def finish_embedding(vector: np.ndarray, params: PoolingParams, config: PoolingConfig) -> list[float]:
    """The pooled vector cut to ``params.dimensions`` (checked against the model's size when the request
    arrived) and normalized as asked, as Python floats."""
    return finish_embeddings(vector, params, config).tolist()


def finish_embeddings(vectors: np.ndarray, params: PoolingParams, config: PoolingConfig) -> np.ndarray:
    """:func:`finish_embedding` of a vector or of each row of a matrix (a per-token task's), float32."""
    if params.dimensions is not None:
        vectors = vectors[..., :params.dimensions]
    vectors = np.asarray(vectors, dtype=np.float64)
    normalize = params.normalize if params.normalize is not None else params.use_activation
    if config.normalize if normalize is None else normalize:
        norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
        vectors = np.divide(vectors, norms, out=vectors.copy(), where=norms > 0)
    return vectors.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Projection:
    """An encoder classifier's layer between its pooled state and its head (float64): ``norm(act(weight @ h +
    bias))``: BERT's pooler and RoBERTa's dense layer (``tanh``, no norm), ModernBERT's head (GELU, LayerNorm)."""

    weight: np.ndarray                 # [hidden, hidden]
    bias: np.ndarray | None
    activation: str = "tanh"           # a transformers activation name
    norm: tuple[np.ndarray, np.ndarray | None, float] | None = None   # LayerNorm weight, bias, eps

    def __call__(self, vector: np.ndarray) -> np.ndarray:
        import torch
        from transformers.activations import ACT2FN

        x = vector @ self.weight.T + (self.bias if self.bias is not None else 0.0)   # (a vector, or one per row)
        x = ACT2FN[self.activation](torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()
        if self.norm is not None:
            weight, bias, eps = self.norm
            mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
            x = (x - mean) / np.sqrt(var + eps) * weight + (bias if bias is not None else 0.0)
        return x


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    """A sequence classifier's ``score`` layer (float64) and how its logits become probabilities: transformers'
    text-classification rule: none for ``problem_type`` ``regression``, a sigmoid per label for
    ``multi_label_classification`` or a single label, else a softmax over the labels."""

    weight: np.ndarray             # [labels, hidden]
    bias: np.ndarray | None        # [labels]
    activation: str                # "softmax", "sigmoid" or "none"
    labels: tuple[str, ...]        # each label's name (the config's id2label)
    pad_token_id: int | None = None   # trailing ones are not read (transformers pools the last other token)
    #: an encoder's layer before the head (BERT's pooler, RoBERTa's dense layer, ModernBERT's head), or ``None``
    pre: Projection | None = None
    #: a token classifier (``*ForTokenClassification``): the head labels each prompt position
    per_token: bool = False

    @classmethod
    def of(cls, hf_config: Any, weight: np.ndarray, bias: np.ndarray | None,
           labels: tuple[str, ...] | None = None, pre: Projection | None = None,
           encoder: bool = False, per_token: bool = False) -> ClassifierHead:
        """The head of ``weight`` and ``bias``; ``labels``: their names (default: the config's ``id2label``);
        ``pre``: an encoder's projection before it; ``encoder``: the model reads its first token (every token: no
        trailing pad tokens are left out); ``per_token``: a token classifier (every position labeled, softmax over
        the labels as transformers' token-classification pipeline takes it)."""
        problem = getattr(hf_config, "problem_type", None)
        count = weight.shape[0]
        activation = ("none" if problem == "regression" and not per_token
                      else "sigmoid" if problem == "multi_label_classification" or count == 1 else "softmax")
        names = dict(getattr(hf_config, "id2label", None) or {})
        labels = labels or tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(count))
        pad = getattr(hf_config, "pad_token_id", None)
        if head_from_tokens(hf_config) or encoder or per_token:   # a causal LM's head rows read at the last token,
            pad = None      # pad or not (as vLLM); an encoder's first token, which sees every token; every token
        return cls(weight, bias, activation, labels,
                   pad if isinstance(pad, int) and not isinstance(pad, bool) else None, pre, per_token)

    def read_tokens(self, ids: list[int]) -> list[int]:
        """The prompt tokens the classifier reads: without trailing pad tokens (transformers' classes pool the last
        token that is not the pad token, and a causal model's hidden state there depends on nothing after it;
        many checkpoints pad with their end-of-sequence token, which their pair template ends with). A prompt of
        pads only keeps its first token (where transformers pools then)."""
        end = len(ids)
        if self.pad_token_id is not None:
            while end > 1 and ids[end - 1] == self.pad_token_id:
                end -= 1
        return ids[:end]

    def probs(self, vector: np.ndarray, activation: bool = True) -> list[float]:
        """The label probabilities of a pooled hidden state (its raw logits without ``activation``)."""
        return self.probs_of(vector, activation).tolist()

    def probs_of(self, vectors: np.ndarray, activation: bool = True) -> np.ndarray:
        """:meth:`probs` of a hidden state or of each row of a matrix (a token classifier's positions), float32."""
        return self.activate(self.logits_of(vectors), activation)

    def logits_of(self, vectors: np.ndarray) -> np.ndarray:
        """The head's logits (float64) of a hidden state or of each row of a matrix."""
        vectors = np.asarray(vectors, dtype=np.float64)
        if self.pre is not None:
            vectors = self.pre(vectors)
        logits = vectors @ self.weight.T
        return logits + self.bias if self.bias is not None else logits

    def activate(self, logits: np.ndarray, activation: bool = True) -> np.ndarray:
        """:meth:`logits_of`'s logits as probabilities (the raw logits without ``activation``), float32."""
        if activation and self.activation == "softmax":
            logits = np.exp(logits - logits.max(axis=-1, keepdims=True))
            logits = logits / logits.sum(axis=-1, keepdims=True)
        elif activation and self.activation == "sigmoid":
            logits = 0.5 * (1.0 + np.tanh(0.5 * logits))   # the logistic function, without overflow
        return logits.astype(np.float32)


def cosine_scores(left: list[list[float]], right: list[list[float]]) -> list[float]:
    """The cosine similarity of each pair ``(left[i], right[i])`` (``left`` may hold one vector for all), in float64,
    clamped to ``[-1, 1]`` (rounding may step past it); 0 where a vector is zero."""
    a = np.asarray(left, dtype=np.float64)
    b = np.asarray(right, dtype=np.float64)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    dots = (a * b).sum(axis=-1)
    scores = np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
    return np.clip(scores, -1.0, 1.0).tolist()


def kept_tokens(ids: list[int], keep: int, encoder: bool = False, special_ids: Any = (),
                closing: bool | None = None) -> list[int]:
    """The tokens ``truncate_prompt_tokens`` keeps of ``ids``, which are more than ``keep``: the last ``keep`` (vLLM's
    rule); for an encoder-only model, which reads its first token, the first ones and a closing special token
    (``[SEP]``, ``</s>``) where ``ids`` end with one in ``special_ids``: what its tokenizer's
    ``truncation=True, max_length=keep`` gives. ``closing``: whether the last one closes the input, said instead
    of read (the same positions of a list that runs beside the tokens, such as their token types)."""
    if not encoder:
        return ids[-keep:]
    ends = ids[-1] in special_ids if closing is None else closing
    tail = ids[-1:] if keep > 1 and ends else []
    return ids[:keep - len(tail)] + tail


def pair_types(length: int, split: int) -> list[int]:
    """The token types of a pair of ``length`` tokens whose second part starts at ``split``: 0 then 1 (BERT's
    segments)."""
    return [0] * split + [1] * (length - split)


def cut_pair(first: list[int], second: list[int], keep: int | None, special: Any = ()) -> tuple[list[int], int]:
    """Two token-id lists joined and cut to ``keep`` tokens (``None``: not cut) as transformers' tokenizers cut a pair
    (``truncation="longest_first"``): a token off the end of the longer list (the second on a tie) at a time, so
    that both keep their beginning. The tokens of ``special`` at either end of each list (an encoder's ``[CLS]``,
    ``[SEP]``, ``</s>``) stay where ``keep`` leaves room for them: only the text between is cut, as the tokenizer
    cuts the texts before it adds them. Returns the joined ids and where the second list's tokens start."""
    def split(ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        a, b = 0, len(ids)
        while a < b and ids[a] in special:
            a += 1
        while b > a and ids[b - 1] in special:
            b -= 1
        return list(ids[:a]), list(ids[a:b]), list(ids[b:])

    (h1, first, t1), (h2, second, t2) = split(first), split(second)
    fixed = len(h1) + len(t1) + len(h2) + len(t2)
    if keep is not None and keep < fixed:   # no room for the special tokens: cut the whole lists
        first, second, fixed = h1 + first + t1, h2 + second + t2, 0
        h1 = t1 = h2 = t2 = []
    while keep is not None and len(first) + len(second) > keep - fixed:
        if len(first) > len(second):
            first.pop()
        else:
            second.pop()
    head = h1 + first + t1
    return head + h2 + second + t2, len(head)


def head_from_tokens(hf_config: Any) -> bool:
    """Whether a classifier is a causal LM read as one: its labels are LM-head rows of ``classifier_from_token``
    (vLLM's recipe for rerankers such as Qwen3-Reranker, set with ``hf_overrides``)."""
    return (getattr(hf_config, "classifier_from_token", None) is not None
            or bool(getattr(hf_config, "is_original_qwen3_reranker", False)))


def check_cross_encoder(head: ClassifierHead | None) -> None:
    """Refuse pair scoring (``/score``, ``/rerank``, ``LLM.score``) by a classifier that is not a cross-encoder.

    Raises:
        RequestRejectedError: more than one label (a cross-encoder's score is its one label's probability).
    """
    from plinth.core.scheduler import RequestRejectedError

    if head is not None and head.per_token:
        raise RequestRejectedError("scoring pairs needs a cross-encoder, a sequence classifier with one label; this is "
                                   "a token classifier")
    if head is not None and len(head.labels) != 1:
        raise RequestRejectedError(f"scoring pairs needs a cross-encoder, a classifier with one label; this one has "
                                   f"{len(head.labels)} ({', '.join(head.labels[:8])}): use classification instead")


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class ClassificationOutput:
    """A classifier's label probabilities (``probs``, in label order), as vLLM's ``ClassificationOutput``."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class PoolingOutput:
    """A pooling request's result as ``LLM.encode`` gives it (vLLM's ``PoolingOutput``): ``data``, a float32 tensor:
    the embedding or the label probabilities (``[dim]``), or one row per prompt token (``[tokens, dim]``: the
    ``token_embed`` and ``token_classify`` tasks)."""

    data: Any


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """One pair's similarity from ``LLM.score`` (``outputs.score``), as vLLM's ``ScoringRequestOutput``: the request
    ids and prompt tokens of the pair's two embeddings, joined."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclasses.dataclass
class PoolingRequestOutput:
    """An embedding request's result (``outputs.embedding``), as vLLM's ``EmbeddingRequestOutput``; a classification
    request's (``outputs.probs``) is a :class:`ClassificationRequestOutput`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: Any
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: Any = None


@dataclasses.dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """A classification request's result (``outputs.probs``), as vLLM's ``ClassificationRequestOutput``."""
