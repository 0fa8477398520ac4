"""IncrementalDetokenizer on real (small, trained in memory) tokenizers."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from plinth.core.detokenizer import IncrementalDetokenizer
from plinth.core.request import SamplingParams

CORPUS = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "日本語のテキストです。東京は日本の首都です。",
    "emoji 😀 and 🎉 party, 你好世界",
    "Stop here ### and there. Answer: 42",
] * 5
SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def _train(tok: Tokenizer, alphabet: list[str]) -> PreTrainedTokenizerFast:
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 style: bytes mapped to characters, so one character may span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _train(tok, pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece style: '▁' marks a space and decoding drops the leading one."""
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return _train(tok, [])


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    """Llama/Mistral SentencePiece style: characters outside the vocabulary become ``<0xXX>`` byte tokens, and
    the ByteFallback decoder turns a run of them that is not valid UTF-8 into one U+FFFD per byte."""
    import json

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(["Hello world. The lazy dog. hi there, done"] * 3, trainers.BpeTrainer(
        vocab_size=120, special_tokens=SPECIALS, show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    spec["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|endoftext|>")


TEXTS = [
    "Hello world. The lazy dog!",
    "東京 😀 日本 world 🎉! 你好",
    "🎉🎉😀 mixed 日本語 and emoji 👩‍👩‍👧",
]


def stream(tokenizer, prompt_ids, ids, params, chunk_sizes=None, finish=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, stops = [], []
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        chunk = ids[i:i + n]
        i += n
        delta, stop = detok.add_tokens(chunk, finished=finish and i >= len(ids))
        deltas.append(delta)
        stops.append(stop)
    return detok, deltas, stops


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_never_emit_replacement_chars(byte_level, text):
    ids = byte_level.encode(text)
    # the test is only meaningful if some token holds part of a character
    assert any("\ufffd" in byte_level.decode([t]) for t in ids) or text.isascii()
    prompt = byte_level.encode("Answer: ")
    rngs = [random.Random(seed) for seed in range(3)]
    for chunks in [None] + [[rng.randint(1, 3) for _ in ids] for rng in rngs]:
        detok, deltas, _ = stream(byte_level, prompt, ids, SamplingParams(), chunks)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == byte_level.decode(ids) == text
        assert detok.text == text


def test_leading_spaces_of_sentencepiece_tokens_are_kept(metaspace):
    prompt = metaspace.encode("Hello")
    ids = metaspace.encode("Hello world. The lazy dog.")[len(prompt):]
    assert metaspace.decode(ids[:1]) != metaspace.decode(prompt + ids[:1])[len("Hello"):]   # needs context
    _, deltas, _ = stream(metaspace, prompt, ids, SamplingParams())
    assert "".join(deltas) == " world. The lazy dog."


def test_unfinished_character_is_flushed_at_the_end(byte_level):
    ids = byte_level.encode("ok 🚀")                     # not in the corpus: one token per byte
    cut = ids[:-1]
    assert byte_level.decode(cut).endswith("\ufffd")
    detok, deltas, _ = stream(byte_level, [], cut, SamplingParams(), finish=False)
    streamed = "".join(deltas)
    assert streamed.startswith("ok") and "\ufffd" not in streamed
    assert "".join(deltas) + detok.flush() == byte_level.decode(cut)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(byte_level, include):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "fox jumps"
    ids = byte_level.encode(text)
    assert not any(stop in byte_level.decode([t]) for t in ids)       # it spans several tokens
    params = SamplingParams(stop=["nowhere", stop], include_stop_str_in_output=include)
    detok, deltas, stops = stream(byte_level, [], ids, params, finish=False)
    expected = "The quick brown fox jumps" if include else "The quick brown "
    assert "".join(deltas) == detok.text == expected
    assert stops.count(stop) == 1 and detok.stop_reason == stop and detok.finished
    # nothing after the stop string, ever
    assert detok.add_tokens(byte_level.encode(" more"), finished=True) == ("", None)


def test_stop_text_is_held_back_until_decided(byte_level):
    ids = byte_level.encode("Answer: 42 ###")
    params = SamplingParams(stop=["###"])
    detok = IncrementalDetokenizer(byte_level, [], params)
    emitted = ""
    for t in ids:
        delta, _ = detok.add_tokens([t])
        emitted += delta
        assert len(detok.text) - len(emitted) <= 2
        assert "#" not in emitted
    assert emitted + detok.flush() == "Answer: 42 "


def test_earliest_stop_string_wins_and_min_tokens_delays_it(byte_level):
    ids = byte_level.encode("the lazy dog. The quick brown fox")
    detok, deltas, _ = stream(byte_level, [], ids, SamplingParams(stop=["quick", "lazy"]), finish=False)
    assert detok.text == "the " and detok.stop_reason == "lazy"
    params = SamplingParams(stop=["quick", "lazy"], min_tokens=4, max_tokens=20)
    assert len(byte_level.encode("the lazy")) <= 4
    detok, _, _ = stream(byte_level, [], ids, params, finish=False)
    assert detok.stop_reason == "quick" and detok.text == "the lazy dog. The "


class _ByteTable:
    """A tokenizer of four byte strings (only ``decode`` is called); id 10 ends inside a 3-byte character."""
    table = {1: b"Hi", 10: b"x \xe2", 11: b"\x80\x94", 12: b"y"}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("by_token", [False, True], ids=["length", "eos"])
def test_stop_string_in_text_flushed_at_the_end(by_token):
    """A stop string in text held back behind an incomplete character is found when the sequence ends (by length,
    or by an EOS right after it) and cut like any other."""
    d = IncrementalDetokenizer(_ByteTable(), [1], SamplingParams(stop=["x "]))
    ids = [12, 10, 2] if by_token else [12, 10]
    assert d.add_tokens(ids, finished=True, stopped_by_token=by_token) == ("y", "x ")
    assert d.output_text == "y" and d.stop_reason == "x "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(byte_level, skip):
    im_end = byte_level.convert_tokens_to_ids("<|im_end|>")
    ids = byte_level.encode("Hello") + [im_end] + byte_level.encode(" world 😀")
    detok, deltas, _ = stream(byte_level, [], ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == ("Hello world 😀" if skip else "Hello<|im_end|> world 😀")


def test_stop_token_is_not_detokenized(byte_level):
    eos = byte_level.eos_token_id
    ids = byte_level.encode("Hello") + [eos]
    for include, expected in ((False, "Hello"), (True, "Hello<|endoftext|>")):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(byte_level, [], params)
        delta, _ = detok.add_tokens(ids, finished=True, stopped_by_token=True)
        assert delta == expected and detok.num_output_tokens == len(ids)


# ------------------------------------------------------------------ the backend decode shortcut


class _OwnDecode(PreTrainedTokenizerFast):
    """A tokenizer class with its own ``decode``: the shortcut must not bypass it."""

    def decode(self, token_ids, skip_special_tokens=False, **kwargs):
        return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_equals_the_tokenizers_decode(byte_level, metaspace, skip):
    from plinth.core.detokenizer import _stock_backend, make_decoder

    rng = random.Random(5)
    for tok in (byte_level, metaspace):
        assert _stock_backend(tok) is tok.backend_tokenizer
        decode = make_decoder(tok, skip)
        specials = [tok.convert_tokens_to_ids(s) for s in SPECIALS]
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))] + rng.sample(specials, 1)
            rng.shuffle(ids)
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_a_tokenizer_with_its_own_decode_is_called(byte_level):
    from plinth.core.detokenizer import _stock_backend

    own = _OwnDecode(tokenizer_object=byte_level.backend_tokenizer, eos_token="<|endoftext|>")
    assert _stock_backend(own) is None
    ids = byte_level.encode("Hello world")
    detok, deltas, _ = stream(own, [], ids, SamplingParams())
    assert "".join(deltas) == "HELLO WORLD"


@pytest.mark.parametrize("text", TEXTS)
def test_stream_through_the_shortcut_equals_the_plain_decode(byte_level, metaspace, text):
    """The same deltas, token by token, whichever decode path the detokenizer takes."""
    from plinth.core import detokenizer as mod

    for tok in (byte_level, metaspace):
        ids = tok.encode(text)
        prompt = tok.encode("Answer:")
        fast = stream(tok, prompt, ids, SamplingParams(stop=["wor"]))
        slow_detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["wor"]))
        slow_detok._decode = lambda ids, tok=tok: tok.decode(ids, skip_special_tokens=True,  # noqa: B023
                                                             clean_up_tokenization_spaces=False)
        deltas = [slow_detok.add_tokens([t], finished=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
        assert fast[1] == deltas and fast[0].text == slow_detok.text
        assert mod.make_decoder(tok, True)(ids) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", ["hi \u03b6\U0001f642", "\u4f60\u597d\U0001f642 ok", "hi \U0001f642"])
def test_prompt_context_starts_at_a_character(byte_fallback, prompt):
    """A byte-fallback tokenizer's prompt whose last few tokens start inside a character (the bytes of a
    character before an emoji): the output's byte tokens still decode to their characters, as a decode of the
    whole sequence gives them, never U+FFFD."""
    prompt_ids = byte_fallback.encode(prompt, add_special_tokens=False)
    output_ids = byte_fallback.encode("\U0001f642\u03b6 done", add_special_tokens=False)[1:]  # no leading '\u2581'
    expected = byte_fallback.decode(prompt_ids + output_ids)[len(byte_fallback.decode(prompt_ids)):]
    assert "\ufffd" not in expected and "\U0001f642" in expected
    for chunks in (None, [2, 3] * 10):
        detok, deltas, _ = stream(byte_fallback, prompt_ids, output_ids, SamplingParams(), chunks)
        assert "".join(deltas) == detok.text == expected
