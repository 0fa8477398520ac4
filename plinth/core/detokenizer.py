"""Incremental detokenization with stop strings.

Text is decoded over a small sliding window of token ids: ``prefix`` marks where the window
starts (tokens already turned into text, kept as context so that tokenizers that drop a leading
space or merge bytes see what came before) and ``read`` where the last emitted text ended.
New text is the window's decoding minus the decoding of ``ids[prefix:read]``; it is emitted
only when it does not end in U+FFFD, i.e. never half of a multi-byte character split over
byte-level tokens. Only ``decode`` is called, so any transformers tokenizer works; for a fast
tokenizer whose ``decode`` is transformers' own, the Rust tokenizer's ``decode`` is called directly
(the same text, without the Python argument handling around it, which cost several times more).

Stop strings are searched in the text as it grows, across token boundaries. A match ends the
sequence: the stop string is cut from the text (kept with ``include_stop_str_in_output``) and
nothing after it is ever emitted. While a stop string could still be completing, the last
``len(longest stop) - 1`` characters are held back, so a delta is never retracted. As in vLLM,
stop strings are looked for only once ``min_tokens`` tokens have been generated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from plinth.core.request import SamplingParams

# Prompt tokens decoded as context before the first output token; more (up to the second figure) when a
# context of that length starts inside a character.
PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT = 24
# Drop consumed ids from the window once this many have piled up.
_TRIM_AT = 64


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas.

    Args:
        tokenizer: a transformers tokenizer (fast or slow); only ``decode`` is used.
        prompt_token_ids: the prompt (its last few tokens give context).
        params: ``stop``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._decode = make_decoder(tokenizer, params.skip_special_tokens)
        self._ids, self._prefix_text = self._prompt_context(prompt_token_ids)
        self._prefix = 0
        self._read = len(self._ids)
        self._stops = list(params.stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._hold = self._max_stop - 1 if self._stops and not params.include_stop_str_in_output else 0
        self.output_text = ""
        self._emitted = 0            # characters of output_text already returned
        self.num_output_tokens = 0
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """All output text so far, including characters still held back."""
        return self.output_text

    @property
    def emitted_text(self) -> str:
        """The output text returned so far (what a stream has shown): never cut by a later stop string."""
        return self.output_text[:self._emitted]

    def add_tokens(self, new_token_ids: Iterable[int], *, finished: bool = False,
                   stopped_by_token: bool = False) -> tuple[str, str | None]:
        """Decode new output tokens.

        Args:
            new_token_ids: the tokens sampled since the last call.
            finished: the sequence ended (length, EOS, stop id, abort): flush every held-back
                character, even an incomplete one.
            stopped_by_token: the last id is the EOS or stop token id that ended the sequence;
                it is not turned into text unless ``include_stop_str_in_output``.

        Returns:
            ``(delta, stop_string)``: the text to emit now, and the stop string that ended the
            sequence during this call (then the sequence is finished; later calls return ``""``).
        """
        if self.finished:
            return "", None
        ids = new_token_ids if type(new_token_ids) is list else list(new_token_ids)
        if stopped_by_token and ids and not self.params.include_stop_str_in_output:
            self.num_output_tokens += 1
            ids = ids[:-1]
        stop = None
        for token_id in ids:
            self.num_output_tokens += 1
            self._ids.append(token_id)
            piece = self._decode_new()
            if piece:
                self.output_text += piece
                if self._stops:
                    stop = self._check_stop(len(piece))
                    if stop is not None:
                        break
        if finished and stop is None:
            tail = self._flush()   # text held back behind an incomplete character may hold a stop string too
            self.output_text += tail
            if tail and self._stops:
                stop = self._check_stop(len(tail))
        if stop is not None or finished:
            self.finished = True
            end = len(self.output_text)
        else:
            end = max(self._emitted, len(self.output_text) - self._hold)
        delta = self.output_text[self._emitted:end]
        self._emitted = end
        return delta, stop

    def flush(self) -> str:
        """End the sequence: return what is still held back (see ``add_tokens(finished=True)``)."""
        return self.add_tokens((), finished=True)[0]

    # ---------------------------------------------------------------- internals

    def _prompt_context(self, prompt: Sequence[int]) -> tuple[list[int], str | None]:
        """The prompt's last tokens kept as context, and their text. A context that starts with part of a
        character decodes to U+FFFD there, and a byte-fallback decoder (Llama/Mistral SentencePiece) turns the
        whole run of byte tokens it begins, output bytes included, into U+FFFD: so it reaches back a token at a
        time, up to ``_MAX_PROMPT_CONTEXT``, to the start of a character."""
        n = len(prompt)
        start = max(0, n - PROMPT_CONTEXT_TOKENS)
        if start == 0:
            return list(prompt), None
        text = self._decode(list(prompt[start:]))
        for earlier in range(start - 1, max(-1, n - _MAX_PROMPT_CONTEXT - 1), -1):
            if not text.startswith("\ufffd"):
                break
            start, text = earlier, self._decode(list(prompt[earlier:]))
        if text.startswith("\ufffd"):   # no character start within reach (or the prompt holds U+FFFD itself)
            start = max(0, n - PROMPT_CONTEXT_TOKENS)
            return list(prompt[start:]), None
        return list(prompt[start:]), text

    def _decode_new(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(self._prefix_text) or full.endswith("\ufffd"):
            return ""
        piece = full[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return piece

    def _flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        self._prefix_text = None
        return full[len(prefix_text):]

    def _check_stop(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string that ends in the newest characters; cut the text there."""
        if not self._stops or self.num_output_tokens <= self.params.min_tokens:
            return None
        text = self.output_text
        best: tuple[int, str] | None = None
        for s in self._stops:   # only matches that end in the new characters
            i = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = text[:i + len(s)] if self.params.include_stop_str_in_output else text[:i]
        self.stop_reason = s
        return s


def make_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.

    When ``tokenizer`` is a transformers fast tokenizer that keeps the stock ``decode`` and
    ``_decode`` (which, without clean-up, return the backend's decoding unchanged), the backend
    ``tokenizers.Tokenizer.decode`` is returned instead: the same text for the same ids.
    """
    backend = _stock_backend(tokenizer)
    if backend is not None:
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def _stock_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer with transformers' own decode, else None."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or "decode" in vars(tokenizer):
        return None
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None
