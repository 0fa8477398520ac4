"""Token texts and text offsets of the completion and chat routes with a SentencePiece-style tokenizer (``\u2581``
word starts, byte fallback, a BOS the tokenizer adds) and with added tokens marked special: each token's text is
the part of the decoded text it wrote, and ``text_offset`` indexes the choice's text."""

from __future__ import annotations

import json

import pytest
from server_utils import CHATML

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<extra_a>", "<extra_b>"]


def _sentencepiece_model(path):
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bpe.train_from_iterator(["Hello world. The lazy dog. hi there, done the quick brown fox"] * 5,
                            trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS, show_progress=False))
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    spec["model"]["byte_fallback"] = True
    bpe = Tokenizer.from_str(json.dumps(spec))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    # added tokens marked special that are none of the named ones (as SmolLM2's <file_sep>)
    tok.add_special_tokens({"additional_special_tokens": []})
    tok.add_tokens([AddedToken("<extra_a>", special=True), AddedToken("<extra_b>", special=True)],
                   special_tokens=True)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False, initializer_range=0.3)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return tok


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    path = tmp_path_factory.mktemp("sentencepiece")
    tok = _sentencepiece_model(path)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off",
                                                served_model_name="tiny", max_model_len=256))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        yield http, tok


def _complete(http, **body):
    r = http.post("/v1/completions", json={"model": "tiny", "temperature": 0, "logprobs": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _check_offsets(text, tokens, offsets):
    """Each token's text starts at its offset in ``text`` (a word start's space may be missing from the text: the
    prompt's first word) and the offsets never go back."""
    assert offsets == sorted(offsets), offsets
    for token, offset in zip(tokens, offsets, strict=True):
        if token.startswith("bytes:") or token in SPECIALS and token not in text[offset:offset + len(token)]:
            continue
        assert text.startswith(token, offset) or token.startswith(" ") and text.startswith(token[1:], offset), \
            (token, offset, text)


def test_word_start_tokens_keep_their_space(served):
    """A '\u2581the' token decoded alone loses its space; its text, bytes and offset keep it, so the tokens' texts
    join to the choice's text."""
    http, tok = served
    prompt = "Hello world. The lazy dog"
    words = [i for t, i in tok.get_vocab().items() if t.startswith("\u2581") and len(t) > 2]
    assert len(words) > 3
    choice = _complete(http, prompt=prompt, max_tokens=8, echo=True, ignore_eos=True, allowed_token_ids=words)
    lp = choice["logprobs"]
    ids = tok(prompt).input_ids
    generated = lp["tokens"][len(ids):]
    assert all(t.startswith(" ") for t in generated) and "".join(generated) == choice["text"][len(prompt):]
    assert lp["tokens"][0] == "<s>" and lp["text_offset"][0] == 0   # the added BOS takes no characters
    assert "".join(lp["tokens"][1:len(ids)]) == " " + prompt   # the decoder strips the text's first space
    assert any(t.startswith(" ") for t in lp["tokens"][1:len(ids)])
    _check_offsets(choice["text"], lp["tokens"], lp["text_offset"])
    r = http.post("/v1/chat/completions", json={"model": "tiny", "temperature": 0, "max_tokens": 8, "logprobs": True,
                                                "messages": [{"role": "user", "content": prompt}],
                                                "allowed_token_ids": words})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["message"]["content"]
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    assert all(t.startswith(" ") for t in tokens) and "".join(tokens) == content
    assert b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"]) == content.encode()


def test_echo_of_a_prompt_holding_the_bos_text(served):
    """The tokenizer adds a BOS before '<s>Hello', which holds '<s>' written out: the added one takes no
    characters, the written one its three."""
    http, tok = served
    choice = _complete(http, prompt="<s>Hello", max_tokens=3, echo=True, ignore_eos=True)
    lp = choice["logprobs"]
    assert lp["tokens"][:2] == ["<s>", "<s>"] and lp["text_offset"][:3] == [0, 0, 3]
    _check_offsets(choice["text"], lp["tokens"], lp["text_offset"])


def test_added_special_tokens_take_no_characters(served):
    """Added tokens marked special (not among the tokenizer's named ones) are left out of the text with
    skip_special_tokens, and so take no characters in ``text_offset``."""
    http, tok = served
    extra = tok.convert_tokens_to_ids("<extra_a>")
    choice = _complete(http, prompt="Hello", max_tokens=4, ignore_eos=True, allowed_token_ids=[extra])
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == ["<extra_a>"] * 4
    assert choice["logprobs"]["text_offset"] == [0, 0, 0, 0]
    choice = _complete(http, prompt="Hello", max_tokens=2, ignore_eos=True, allowed_token_ids=[extra],
                       skip_special_tokens=False)
    assert choice["text"] == "<extra_a>" * 2 and choice["logprobs"]["text_offset"] == [0, 9]
