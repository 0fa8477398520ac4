"""Start-up caches: one parse of a GGUF file per process, the converted tokenizer on disk, fast dequantization.

References: gguf's own reader (``gguf.GGUFReader``) for every metadata value and tensor, gguf's numpy
dequantizers for the weights, and a tokenizer converted afresh from the file's metadata (transformers'
GGUF conversion) for the cached one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import gguf
import numpy as np
import pytest
import torch

from plinth.errors import ModelLoadError
from plinth.model_registry import gguf_tokenizer
from plinth.model_registry.gguf_dequant import dequantize_group, dequantize_tensor
from plinth.model_registry.gguf_file import GGUFFile, clear_gguf_cache, open_gguf
from plinth.model_registry.gguf_loader import iter_gguf_raw, iter_gguf_weights, read_gguf_config
from plinth.model_registry.gguf_tokenizer import load_gguf_tokenizer, tokenizer_cache_entry

Q = gguf.GGMLQuantizationType
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nCaf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c \U0001f600<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, tabs\tand\n\nnewlines  ",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
    "",
]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    clear_gguf_cache()
    yield tmp_path / "cache"
    clear_gguf_cache()


def bpe_tokenizer_metadata() -> dict:
    """The conftest's byte-level BPE tokenizer as GGUF metadata (llama.cpp's "gpt2" tokenizer model)."""
    from conftest import make_tokenizer

    state = json.loads(make_tokenizer().backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"]: a["id"] for a in state["added_tokens"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in state["model"]["merges"]]
    return {"tokens": tokens, "merges": merges, "special": special}


def write_small_gguf(path, template: str = TEMPLATE, tokenizer: bool = True, qtype=Q.Q4_1, seed: int = 0,
                     arch: str = "llama", pre: str = "default") -> str:
    """A 2-layer GGUF (llama's tensors; ``arch`` names the architecture) with a BPE tokenizer (``pre``: its
    pre-tokenizer), metadata of every scalar kind, and quantized weights."""
    rng = np.random.default_rng(seed)
    meta = bpe_tokenizer_metadata()
    vocab, hidden, inter, layers = len(meta["tokens"]), 64, 128, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    for add, key, value in ((w.add_uint8, "test.u8", 200), (w.add_int8, "test.i8", -5), (w.add_uint16, "test.u16", 60000),
                            (w.add_int16, "test.i16", -300), (w.add_uint32, "test.u32", 4_000_000_000),
                            (w.add_int32, "test.i32", -7), (w.add_uint64, "test.u64", 2**60), (w.add_int64, "test.i64", -(2**40)),
                            (w.add_float32, "test.f32", 0.1), (w.add_float64, "test.f64", 0.1), (w.add_bool, "test.bool", True),
                            (w.add_string, "test.str", "caf\u00e9"), (w.add_array, "test.ints", [1, 2, 3]),
                            (w.add_array, "test.floats", [0.5, -1.5])):
        add(key, value)
    if tokenizer:
        special = meta["special"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(meta["tokens"])
        w.add_token_merges(meta["merges"])
        w.add_token_types([3 if t in special else 1 for t in meta["tokens"]])
        w.add_bos_token_id(special["<|im_start|>"])
        w.add_eos_token_id(special["<|im_end|>"])
        w.add_pad_token_id(special["<|endoftext|>"])
        w.add_chat_template(template)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (32, hidden),
                   f"blk.{i}.attn_v.weight": (32, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, inter)}
    for name, shape in shapes.items():
        data = rng.normal(0, 0.05, shape).astype(np.float32)
        if len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def count_parses(monkeypatch) -> list[str]:
    calls: list[str] = []
    original = GGUFFile.parse.__func__

    def counting(cls, path):
        calls.append(path)
        return original(cls, path)

    monkeypatch.setattr(GGUFFile, "parse", classmethod(counting))
    return calls


# ------------------------------------------------------------------------------------------ the reader


def test_header_equals_gguf_reader(tmp_path):
    path = write_small_gguf(tmp_path / "m.gguf")
    ours = open_gguf(path)
    theirs = gguf.GGUFReader(path)
    assert list(ours.metadata) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's pseudo-fields for the header counts
            continue
        assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.ggml_type == ref.tensor_type and mine.offset == ref.data_offset and mine.n_bytes == ref.n_bytes
        assert mine.shape == tuple(reversed(ref.shape.tolist()))
        data = ours.tensor_data(mine)
        assert data.dtype == ref.data.dtype and data.shape == ref.data.shape and not data.flags.writeable
        assert np.array_equal(data, ref.data), mine.name


def test_one_parse_per_file_and_process(tmp_path, monkeypatch):
    """Config, raw tensors, weights and tokenizer of one start read one parsed header."""
    path = write_small_gguf(tmp_path / "m.gguf")
    parses = count_parses(monkeypatch)
    read_gguf_config(path)
    list(iter_gguf_raw(path))
    list(iter_gguf_weights(path, torch.bfloat16))
    load_gguf_tokenizer(path)
    assert len(parses) == 1
    assert open_gguf(path) is open_gguf(os.path.join(str(tmp_path), ".", "m.gguf"))
    assert len(parses) == 1


def test_changed_file_is_parsed_again(tmp_path, monkeypatch):
    path = write_small_gguf(tmp_path / "m.gguf")
    parses = count_parses(monkeypatch)
    first = open_gguf(path)
    os.replace(write_small_gguf(tmp_path / "other.gguf", seed=1), path)  # new contents, new inode
    second = open_gguf(path)
    assert second is not first and len(parses) == 2
    name = "blk.0.attn_q.weight"
    tensor = next(t for t in second.tensors if t.name == name)
    assert np.array_equal(second.tensor_data(tensor), gguf.GGUFReader(path).get_tensor(
        [t.name for t in gguf.GGUFReader(path).tensors].index(name)).data)
    # a rewrite in place (same inode) with a new modification time is seen as well
    with open(path, "r+b") as f:
        f.write(b"GGUF")
    os.utime(path, ns=(second.identity[3] + 10**9, second.identity[3] + 10**9))
    assert open_gguf(path) is not second and len(parses) == 3


@pytest.mark.parametrize("damage", ["version", "alignment", "count"])
def test_corrupt_header_is_a_model_load_error(tmp_path, damage):
    path = write_small_gguf(tmp_path / "m.gguf", tokenizer=False)
    data = bytearray(open(path, "rb").read())
    if damage == "version":
        data[4:8] = (1).to_bytes(4, "little")
        match = "version 1; supported versions: 2, 3"
    elif damage == "count":
        data[16:24] = (2**62).to_bytes(8, "little")  # metadata count far beyond the file
        match = "truncated or corrupt"
    else:
        data[4:8] = (3 << 16).to_bytes(4, "little")  # how a big-endian file's version reads here
        match = "other byte order"
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=match):
        open_gguf(str(tmp_path / "bad.gguf"))


def test_string_arrays_are_decoded_when_read(tmp_path):
    """The header's arrays of strings (a tokenizer's tokens and merges) are walked past by the parse and
    decoded on first use; a string that is not UTF-8 is a ModelLoadError then, and a length that runs past
    the file one at the parse."""
    from plinth.model_registry.gguf_file import StringArray

    path = write_small_gguf(tmp_path / "m.gguf")
    tokens = bpe_tokenizer_metadata()["tokens"]
    ours = open_gguf(path).metadata["tokenizer.ggml.tokens"]
    assert isinstance(ours, StringArray) and len(ours) == len(tokens) and ours._items is None
    assert ours == tokens and ours[1] == tokens[1] and list(ours)[-1] == tokens[-1]
    data = bytearray(open(path, "rb").read())
    first = len(tokens[0].encode()).to_bytes(8, "little") + tokens[0].encode()
    at = data.find(first)
    assert at > 0
    bad = bytearray(data)
    bad[at + 8] = 0xFF   # not UTF-8
    (tmp_path / "bad.gguf").write_bytes(bytes(bad))
    damaged = open_gguf(str(tmp_path / "bad.gguf")).metadata["tokenizer.ggml.tokens"]
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        damaged[0]
    for i, length in enumerate((2**40, 2**64 - 1)):   # lengths far beyond the file (the last past any offset)
        data[at:at + 8] = length.to_bytes(8, "little")
        (tmp_path / f"long{i}.gguf").write_bytes(bytes(data))
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            open_gguf(str(tmp_path / f"long{i}.gguf"))


# --------------------------------------------------------------------------------------- dequantizing


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_gguf(qtype, dtype):
    values = np.random.default_rng(int(qtype)).normal(0, 0.05, (48, 256)).astype(np.float32)
    stored = gguf.quants.quantize(values, qtype)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(stored, qtype), dtype=np.float32)).to(dtype)
    got = dequantize_tensor(stored, qtype, (48, 256), dtype)
    assert got.dtype == dtype and got.shape == (48, 256)
    assert torch.equal(got, want)


def test_group_dequantization_equals_one_by_one():
    """Tensors of several types and shapes expanded together come back as each would alone, in order."""
    rng = np.random.default_rng(7)
    items = []
    for qtype, shape in [(Q.Q4_1, (64, 96)), (Q.F32, (32,)), (Q.Q8_0, (16, 64)), (Q.Q4_1, (8, 32)),
                         (Q.Q5_0, (8, 64)), (Q.Q4_0, (24, 128)), (Q.Q8_0, (40, 32)), (Q.Q4_1, (3, 256))]:
        values = rng.normal(0, 0.05, shape).astype(np.float32)
        items.append((gguf.quants.quantize(values, qtype) if len(shape) == 2 else values, qtype, shape))
    grouped = dequantize_group(items, torch.bfloat16)
    assert len(grouped) == len(items)
    for (data, qtype, shape), got in zip(items, grouped, strict=True):
        want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)).to(torch.bfloat16)
        assert got.shape == shape and torch.equal(got, want.reshape(shape)), qtype.name


# ------------------------------------------------------------------------------------ tokenizer cache


def assert_same_tokenizer(got, want):
    for text in TEXTS:
        for special in (True, False):
            ids = want(text, add_special_tokens=special)["input_ids"]
            assert got(text, add_special_tokens=special)["input_ids"] == ids, text
            assert got.decode(ids) == want.decode(ids)
            assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True)
    assert (got.bos_token, got.eos_token, got.pad_token) == (want.bos_token, want.eos_token, want.pad_token)
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (want.bos_token_id, want.eos_token_id,
                                                                      want.pad_token_id)
    assert got.chat_template == want.chat_template and len(got) == len(want)
    messages = [{"role": "user", "content": TEXTS[0]}]
    assert got.apply_chat_template(messages, tokenize=False) == want.apply_chat_template(messages, tokenize=False)


def count_conversions(monkeypatch) -> list[str]:
    calls: list[str] = []
    original = gguf_tokenizer._convert

    def counting(path, reader):
        calls.append(path)
        return original(path, reader)

    monkeypatch.setattr(gguf_tokenizer, "_convert", counting)
    return calls


def test_tokenizer_cached_on_disk_and_identical(tmp_path, monkeypatch, private_cache):
    path = write_small_gguf(tmp_path / "m.gguf")
    fresh = load_gguf_tokenizer(path, use_cache=False)
    conversions = count_conversions(monkeypatch)
    first = load_gguf_tokenizer(path)
    entry = tokenizer_cache_entry(path)
    assert entry.parent == private_cache / "tokenizers" and len(conversions) == 1
    assert sorted(os.listdir(entry)) == ["chat_template.jinja", "source.json", "tokenizer.json", "tokenizer_config.json"]
    clear_gguf_cache()  # as a new process would
    cached = load_gguf_tokenizer(path)
    assert len(conversions) == 1  # the second load read the disk cache
    assert_same_tokenizer(first, fresh)
    assert_same_tokenizer(cached, fresh)
    assert cached.eos_token == "<|im_end|>" and cached.chat_template == TEMPLATE


@pytest.mark.parametrize("arch, pre", [("llama", "default"), ("qwen2", "qwen2"), ("qwen3", "qwen2")])
def test_the_cached_tokenizer_tokenizes_as_the_converted_one(tmp_path, private_cache, arch, pre):
    """A Qwen2/Qwen3 file's tokenizer converts to transformers' Qwen2Tokenizer, whose own constructor rebuilt the
    cached pipeline (an NFC normalizer, its own split) when the entry was read back: every start after the first
    tokenized differently. The entry now reloads exactly as converted (else it names the generic class)."""
    path = write_small_gguf(tmp_path / "m.gguf", arch=arch, pre=pre)
    fresh = load_gguf_tokenizer(path, use_cache=False)
    load_gguf_tokenizer(path)
    clear_gguf_cache()  # as a new process would
    cached = load_gguf_tokenizer(path)
    assert (tokenizer_cache_entry(path) / "source.json").is_file()   # it is cached
    assert_same_tokenizer(cached, fresh)
    for text in ("a   \n\n  b cafe\u0301", "x\u00a0\u00a0y  \t z"):   # decomposed letters, runs of white space
        assert cached(text)["input_ids"] == fresh(text)["input_ids"], text


def test_tokenizer_cache_invalidated_when_the_file_changes(tmp_path, monkeypatch, private_cache):
    path = write_small_gguf(tmp_path / "m.gguf")
    conversions = count_conversions(monkeypatch)
    old_entry = tokenizer_cache_entry(path)
    assert load_gguf_tokenizer(path).chat_template == TEMPLATE
    other = TEMPLATE.replace("<|im_end|>", "<|endoftext|>")
    os.replace(write_small_gguf(tmp_path / "new.gguf", template=other), path)
    os.utime(path, ns=(os.stat(path).st_mtime_ns + 10**9,) * 2)
    new = load_gguf_tokenizer(path)
    assert len(conversions) == 2 and new.chat_template == other
    assert tokenizer_cache_entry(path) != old_entry
    assert os.listdir(private_cache / "tokenizers") == [tokenizer_cache_entry(path).name]  # the old entry is gone
    assert_same_tokenizer(new, load_gguf_tokenizer(path, use_cache=False))


@pytest.mark.parametrize("damage", ["truncated", "foreign_file", "other_source", "config_not_object",
                                    "class_not_text", "template_cut"])
def test_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch, caplog, damage):
    path = write_small_gguf(tmp_path / "m.gguf")
    load_gguf_tokenizer(path)
    entry = tokenizer_cache_entry(path)
    if damage in ("config_not_object", "class_not_text"):   # transformers fails on them with other errors
        (entry / "tokenizer_config.json").write_text("[]" if damage == "config_not_object" else
                                                     '{"tokenizer_class": 5}')
    elif damage == "truncated":
        data = (entry / "tokenizer.json").read_bytes()
        (entry / "tokenizer.json").write_bytes(data[: len(data) // 2])
    elif damage == "template_cut":   # a template cut short would otherwise be used (or refused) as it is
        text = (entry / "chat_template.jinja").read_text()
        (entry / "chat_template.jinja").write_text(text[: len(text) // 2])
    elif damage == "foreign_file":
        (entry / "tokenizer.py").write_text("raise SystemExit('code in a cache entry must never run')\n")
    else:
        record = json.loads((entry / "source.json").read_text())
        (entry / "source.json").write_text(json.dumps({**record, "size": record["size"] + 1}))
    conversions = count_conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=gguf_tokenizer.__name__):
        tokenizer = load_gguf_tokenizer(path)
    assert len(conversions) == 1 and "ignoring the tokenizer cache entry" in caplog.text
    assert_same_tokenizer(tokenizer, load_gguf_tokenizer(path, use_cache=False))
    assert tokenizer.chat_template == TEMPLATE
    caplog.clear()   # the damaged entry was replaced: the next start reads it, with no warning
    with caplog.at_level(logging.WARNING, logger=gguf_tokenizer.__name__):
        again = load_gguf_tokenizer(path)
    assert len(conversions) == 2 and "ignoring" not in caplog.text   # (the use_cache=False load above converted)
    assert_same_tokenizer(again, tokenizer)
    assert os.listdir(entry.parent) == [entry.name]


def test_a_good_entry_another_process_finished_is_kept(tmp_path, private_cache):
    """Two cold starts convert at once: the one that stores second keeps the first one's good entry (replacing it
    would leave a moment without one, which a third start would find missing) and drops its own copy."""
    path = write_small_gguf(tmp_path / "m.gguf")
    tokenizer = load_gguf_tokenizer(path)
    entry = tokenizer_cache_entry(path)
    inode = entry.stat().st_ino
    record = json.loads((entry / "source.json").read_text())
    gguf_tokenizer._store_entry(tokenizer, entry, record)   # the second process's store
    assert entry.stat().st_ino == inode and os.listdir(entry.parent) == [entry.name]


def test_a_full_disk_while_caching_the_tokenizer_is_a_warning(tmp_path, monkeypatch, caplog, private_cache):
    """The tokenizers library reports a full disk as a bare ``Exception``: the start goes on uncached, warned, and
    leaves no temporary directory behind."""
    from transformers import PreTrainedTokenizerFast

    def full(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")   # noqa: TRY002 - as the tokenizers library

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full)
    path = write_small_gguf(tmp_path / "m.gguf")
    with caplog.at_level(logging.WARNING, logger=gguf_tokenizer.__name__):
        tokenizer = load_gguf_tokenizer(path)
    assert "could not write the tokenizer cache entry" in caplog.text and "No space left" in caplog.text
    assert os.listdir(private_cache / "tokenizers") == []
    monkeypatch.undo()
    assert_same_tokenizer(tokenizer, load_gguf_tokenizer(path, use_cache=False))


def test_environments_with_other_transformers_keep_their_own_entries(tmp_path, monkeypatch, private_cache):
    """Two environments (two transformers versions) sharing the cache each keep their entry of one file instead of
    removing each other's and converting at every start; a start killed while writing (Ctrl-C) leaves no temporary
    folder, and one left by a killed process long ago is removed by the next entry written."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    path = write_small_gguf(tmp_path / "m.gguf")
    conversions = count_conversions(monkeypatch)
    load_gguf_tokenizer(path)
    mine = tokenizer_cache_entry(path)
    clear_gguf_cache()
    with monkeypatch.context() as m:   # (not monkeypatch.undo(): that would also undo the private cache directory)
        m.setattr(transformers, "__version__", "9.9.9")
        load_gguf_tokenizer(path)
        theirs = tokenizer_cache_entry(path)
    assert theirs != mine and sorted(os.listdir(private_cache / "tokenizers")) == sorted([mine.name, theirs.name])
    conversions.clear()
    clear_gguf_cache()
    load_gguf_tokenizer(path)
    assert conversions == []   # this environment's entry was kept

    leftover = private_cache / "tokenizers" / f".{mine.name}.killed"
    leftover.mkdir()
    os.utime(leftover, (1, 1))
    recent = private_cache / "tokenizers" / f".{mine.name}.writing"
    recent.mkdir()   # another process writing now: kept

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    shutil.rmtree(mine)
    clear_gguf_cache()
    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerFast, "save_pretrained", interrupted)
        with pytest.raises(KeyboardInterrupt):
            load_gguf_tokenizer(path)
    assert sorted(os.listdir(private_cache / "tokenizers")) == sorted([theirs.name, leftover.name, recent.name])
    clear_gguf_cache()
    load_gguf_tokenizer(path)
    assert sorted(os.listdir(private_cache / "tokenizers")) == sorted([mine.name, theirs.name, recent.name])
    # the other environment's entry, unread for 90 days (that transformers is gone), goes with the next write
    os.utime(theirs / "source.json", (1, 1))
    os.utime(path, ns=(1, 10**18))   # another state of the file: a new entry is written
    clear_gguf_cache()
    load_gguf_tokenizer(path)
    assert sorted(os.listdir(private_cache / "tokenizers")) == sorted([tokenizer_cache_entry(path).name, recent.name])


def test_unwritable_cache_still_loads(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(blocker / "cache"))
    path = write_small_gguf(tmp_path / "m.gguf")
    with caplog.at_level(logging.WARNING, logger=gguf_tokenizer.__name__):
        tokenizer = load_gguf_tokenizer(path)
    assert "could not write the tokenizer cache" in caplog.text
    assert_same_tokenizer(tokenizer, load_gguf_tokenizer(path, use_cache=False))


# ----------------------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def default_gguf():
    from plinth.model_registry.default_model import default_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PLINTH_DEFAULT_MODEL", raising=False)
        mp.delenv("PLINTH_CACHE_DIR", raising=False)
        return default_model_path()


@pytest.mark.slow
def test_default_model_header_and_tokenizer(default_gguf, monkeypatch):
    ours = open_gguf(default_gguf)
    theirs = gguf.GGUFReader(default_gguf)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.chat_template", "llama.block_count", "general.architecture"):
        assert ours.metadata[key] == theirs.fields[key].contents(), key
    assert [(t.name, t.offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in theirs.tensors]
    conversions = count_conversions(monkeypatch)
    load_gguf_tokenizer(default_gguf)
    clear_gguf_cache()
    cached = load_gguf_tokenizer(default_gguf)
    assert len(conversions) == 1
    assert_same_tokenizer(cached, load_gguf_tokenizer(default_gguf, use_cache=False))



def test_dequantization_scratch_is_reused_only_when_free():
    """The loader's float32 expansion buffers are reused from one group to the next, never while a tensor
    (or any view) still shares their storage: a weight kept by a loader stays intact."""
    from plinth.model_registry.gguf_dequant import Scratch, _storage_uses, dequantize_group

    if _storage_uses(torch.empty(1)) is None:
        pytest.skip("this torch does not count a storage's users")
    rng = np.random.default_rng(0)
    values = [rng.normal(0, 0.05, (64, 256)).astype(np.float32) for _ in range(4)]
    items = [(gguf.quants.quantize(v, Q.Q4_1), Q.Q4_1, v.shape) for v in values]
    want = [torch.from_numpy(np.asarray(gguf.quants.dequantize(i[0], Q.Q4_1), dtype=np.float32)) for i in items]
    scratch = Scratch()
    first = dequantize_group(items[:2], torch.float32, scratch)
    kept = first[0][3:9]                     # a loader keeps a view of one weight
    first_ptr = first[1].untyped_storage().data_ptr()
    del first
    second = dequantize_group(items[2:], torch.float32, scratch)
    assert second[0].untyped_storage().data_ptr() != first_ptr   # in use: a new buffer
    assert torch.equal(kept, want[0][3:9]) and torch.equal(second[0], want[2]) and torch.equal(second[1], want[3])
    second_ptr = second[0].untyped_storage().data_ptr()
    del kept, second
    third = dequantize_group(items[:2], torch.float32, scratch)   # both buffers free again: one is reused
    assert third[0].untyped_storage().data_ptr() in (first_ptr, second_ptr)
    assert torch.equal(third[0], want[0]) and torch.equal(third[1], want[1])
    bf16 = dequantize_group(items[2:], torch.bfloat16, scratch)   # bfloat16 results are copies
    assert torch.equal(bf16[0], want[2].to(torch.bfloat16)) and torch.equal(third[1], want[1])


def test_engine_start_imports_no_model_config_class_or_sympy(tmp_path):
    """With warm caches a GGUF model starts without transformers' model modules (the config classes pull in
    torch.distributed.tensor, AutoTokenizer scans every model's source) or sympy: about 1.5 s of a start."""
    import subprocess
    import sys

    path = write_small_gguf(tmp_path / "m.gguf")
    script = (
        "import sys, plinth\n"
        f"llm = plinth.LLM({path!r}, max_model_len=64)\n"
        "out = llm.generate(['hello'], plinth.SamplingParams(max_tokens=2, ignore_eos=True))\n"
        "assert len(out[0].outputs[0].token_ids) == 2\n"
        "print(sorted(m for m in sys.modules if m == 'sympy' or m.startswith('transformers.models')\n"
        "             or m == 'torch.distributed.tensor'))\n"
    )
    env = {**os.environ, "PLINTH_CACHE_DIR": str(tmp_path / "cache")}
    loaded = []
    for _ in range(2):  # the first start converts the tokenizer (transformers' GGUF code) and fills the caches
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        loaded.append(done.stdout.strip().splitlines()[-1])
    assert "configuration_llama" in loaded[0]  # the check sees these imports when they happen
    assert loaded[1] == "[]"


@pytest.mark.parametrize("saved,generic", [("TokenizersBackend", True), ("PreTrainedTokenizerFast", True),
                                           ("LlamaTokenizer", False), (None, False)])
def test_cache_entry_class(tmp_path, saved, generic):
    """Entries of transformers' generic fast tokenizer load through that class; any other through AutoTokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if saved is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": saved}))
    want = PreTrainedTokenizerFast if generic else AutoTokenizer
    assert gguf_tokenizer._tokenizer_class(tmp_path) is want
