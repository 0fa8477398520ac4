"""The tokenizer of a GGUF file: converted from its metadata once, then kept on disk.

transformers builds a fast tokenizer from a GGUF file's vocabulary, merges and special-token ids; that
takes seconds (it reads the whole header again with gguf's reader). The converted tokenizer is saved
with ``save_pretrained`` under ``$PLINTH_CACHE_DIR/tokenizers/<key>/`` and later starts load it from there
in a fraction of a second. An entry holds data only (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja`` and plinth's own ``source.json``); it is loaded with ``trust_remote_code=False``,
and an entry holding any other kind of file, or a chat template other than the file's metadata, is ignored.

The key is the GGUF file's real path, size and modification time, transformers' version and this
module's format number: a changed file (or another transformers) gets a fresh conversion, and the entry
of the file's previous state is removed when the new one is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from plinth.config import cache_dir
from plinth.errors import ModelLoadError
from plinth.model_registry.gguf_file import GGUFFile, StringArray, open_gguf

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2   # 2: entries whose class would not reload them as converted name the generic class
_SOURCE_FILE = "source.json"  # written last: an entry without it is incomplete
_DATA_SUFFIXES = (".json", ".jinja")
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers 5 and 4 names of one class
_SPECIAL_TOKENS = (
    ("bos_token", "tokenizer.ggml.bos_token_id"),
    ("eos_token", "tokenizer.ggml.eos_token_id"),
    ("pad_token", "tokenizer.ggml.padding_token_id"),
)


def _source_record(path: str) -> dict[str, Any]:
    """What the cache entry of ``path`` is keyed by (and records, to be checked on load)."""
    import transformers

    real = os.path.realpath(path)
    st = os.stat(real)
    return {"format": CACHE_FORMAT, "source": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino, "ctime_ns": st.st_ctime_ns, "transformers": transformers.__version__}


def tokenizer_cache_entry(path: str) -> Path:
    """The cache directory of the tokenizer of GGUF file ``path`` in its current state (may not exist)."""
    record = _source_record(path)
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "tokenizers" / key


def load_gguf_tokenizer(path: str, use_cache: bool = True) -> Any:
    """A transformers tokenizer built from a GGUF file's metadata, offline.

    The chat template (``tokenizer.chat_template``) and the BOS/EOS/padding tokens are set from the
    metadata. With ``use_cache`` the converted tokenizer is read from (or written to) plinth's cache.

    Raises:
        ModelLoadError: an unreadable file, a file without a tokenizer, or a tokenizer transformers
            cannot build.
    """
    path = os.path.abspath(path)
    reader = open_gguf(path)
    if reader.get("tokenizer.ggml.model") is None or "tokenizer.ggml.tokens" not in reader.metadata:
        raise ModelLoadError(
            f"GGUF file {path!r} holds no tokenizer (no tokenizer.ggml.model/tokens metadata); "
            "give a tokenizer directory separately"
        )
    tokens = reader.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, StringArray) and not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
        raise ModelLoadError(f"GGUF file {path!r}: tokenizer.ggml.tokens must be an array of strings, got "
                             f"{type(tokens).__name__}")
    if reader.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" not in reader.metadata:
        raise ModelLoadError(f"GGUF file {path!r}: its BPE tokenizer (tokenizer.ggml.model 'gpt2') has no "
                             "tokenizer.ggml.merges; give a tokenizer directory separately")
    if not use_cache:
        return _convert(path, reader)
    record = _source_record(path)
    entry = tokenizer_cache_entry(path)
    start = time.perf_counter()
    tokenizer = _load_entry(entry, record)
    template = reader.get("tokenizer.chat_template")
    if tokenizer is not None and template is not None and tokenizer.chat_template != template:
        logger.warning("ignoring the tokenizer cache entry %s: its chat template is not the file's", entry)
        tokenizer = None
    if tokenizer is not None:
        logger.info("tokenizer of %s from the cache %s in %.2f s", os.path.basename(path), entry,
                    time.perf_counter() - start)
        return tokenizer
    tokenizer = _convert(path, reader)
    logger.info("tokenizer of %s converted from its metadata in %.2f s", os.path.basename(path),
                time.perf_counter() - start)
    _store_entry(tokenizer, entry, record)
    return tokenizer


def _convert(path: str, reader: GGUFFile) -> Any:
    from transformers import AutoTokenizer

    tokens = reader.get("tokenizer.ggml.tokens")
    for _, key in _SPECIAL_TOKENS:
        token_id = reader.get(key)
        if token_id is not None and (not isinstance(token_id, int) or tokens is None
                                     or not 0 <= token_id < len(tokens)):
            raise ModelLoadError(f"GGUF file {path!r}: {key} is {token_id!r}, not the id of one of the file's "
                                 f"{len(tokens) if tokens is not None else 0} tokens")
    folder, name = os.path.dirname(path), os.path.basename(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception:  # noqa: BLE001 - transformers and tokenizers raise many types for metadata they cannot use
        # AutoTokenizer first reads the file as a transformers model config to pick a tokenizer class, and refuses
        # architectures transformers does not load from GGUF (deepseek2, granite, olmoe, ...); the tokenizer itself
        # comes from the tokenizer.ggml.* metadata alone, which the generic fast tokenizer reads for any of them
        from transformers import PreTrainedTokenizerFast

        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
        except Exception as e:  # noqa: BLE001 - as above; the generic reader's error names the metadata at fault
            raise ModelLoadError(f"could not build a tokenizer from GGUF file {path!r}: {type(e).__name__}: "
                                 f"{e}") from None
    template = reader.get("tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    for attribute, key in _SPECIAL_TOKENS:
        token_id = reader.get(key)
        if token_id is not None:
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def _tokenizer_class(entry: Path) -> Any:
    """The class that reads ``entry``: transformers' generic fast tokenizer when the entry names it (what
    GGUF conversions give), which skips ``AutoTokenizer``'s scan of every model module (about 0.5 s)."""
    try:
        saved = json.loads((entry / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        saved = None
    if saved in _GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def _load_entry(entry: Path, record: dict[str, Any], warn: bool = True) -> Any:
    """The tokenizer saved in ``entry``; None when there is none, or it is incomplete, foreign or unreadable
    (warned about unless ``warn`` is false)."""
    report = logger.warning if warn else logger.debug
    try:
        saved = json.loads((entry / _SOURCE_FILE).read_text(encoding="utf-8"))
        names = os.listdir(entry)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        report("ignoring the tokenizer cache entry %s: %s", entry, e)
        return None
    if saved != record:
        report("ignoring the tokenizer cache entry %s: it was made from %s", entry, saved)
        return None
    foreign = [n for n in names if not n.endswith(_DATA_SUFFIXES)]
    if foreign:
        report("ignoring the tokenizer cache entry %s: it holds files other than JSON and templates: %s",
               entry, ", ".join(sorted(foreign)))
        return None
    try:
        tokenizer = _tokenizer_class(entry).from_pretrained(str(entry), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any damage to an entry (a config of the wrong shape) means converting again
        report("ignoring the tokenizer cache entry %s: %s: %s", entry, type(e).__name__, e)
        return None
    with contextlib.suppress(OSError):   # in use: kept by the pruning of entries no start reads
        os.utime(entry / _SOURCE_FILE)
    return tokenizer


def _store_entry(tokenizer: Any, entry: Path, record: dict[str, Any]) -> None:
    """Save ``tokenizer`` as ``entry`` atomically (a temporary directory renamed into place), then drop
    the entries of earlier states of the same file. A cache that cannot be written is only a warning."""
    root = entry.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
    except OSError as e:
        logger.warning("could not write the tokenizer cache under %s: %s", root, e)
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        if not _reloads_as(tokenizer, tmp):
            # the model's own class rebuilds parts of the saved pipeline (Qwen2Tokenizer: its own normalizer and
            # split): the generic class reads tokenizer.json as saved
            _name_generic_class(tmp)
            if not _reloads_as(tokenizer, tmp):
                logger.info("the tokenizer of %s is not cached: it does not reload as converted", record["source"])
                shutil.rmtree(tmp, ignore_errors=True)
                return
        (tmp / _SOURCE_FILE).write_text(json.dumps(record, sort_keys=True), encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like the model files
        if entry.exists():
            existing = _load_entry(entry, record, warn=False)
            if existing is not None and existing.chat_template == tokenizer.chat_template:
                shutil.rmtree(tmp, ignore_errors=True)   # another process's entry, finished meanwhile: keep it
                return
            # one that does not load (damaged, or of another conversion): replace it
            doomed = Path(tempfile.mkdtemp(prefix=f".{entry.name}.old.", dir=root))
            try:
                os.rename(entry, doomed / "entry")
            except FileNotFoundError:   # another process moved it first
                pass
            shutil.rmtree(doomed, ignore_errors=True)
        os.rename(tmp, entry)
    except BaseException as e:  # OSError, the tokenizers library's bare Exception on a full disk; Ctrl-C
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):
            raise
        if not (entry / _SOURCE_FILE).is_file():  # not another process's finished entry
            logger.warning("could not write the tokenizer cache entry %s: %s", entry, e)
        return
    _remove_stale_entries(root, entry.name, record)


def _pipeline(tokenizer: Any) -> Any:
    """The tokenizer's pipeline (normalizer, pre-tokenizer, model, post-processor, decoder, added tokens)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    return spec


def _reloads_as(tokenizer: Any, saved: Path) -> bool:
    """Whether the tokenizer saved in ``saved`` loads back (as the cache will load it) with ``tokenizer``'s
    pipeline and special tokens."""
    try:
        again = _tokenizer_class(saved).from_pretrained(str(saved), local_files_only=True, trust_remote_code=False)
        return _pipeline(again) == _pipeline(tokenizer) and \
            again.all_special_tokens == tokenizer.all_special_tokens
    except Exception:  # noqa: BLE001 - not loadable back: not cached
        return False


def _name_generic_class(saved: Path) -> None:
    config_path = saved / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = _GENERIC_CLASSES[0]
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


#: the parts of a record that only say which state of the file an entry was made from
_FILE_STATE = ("size", "mtime_ns", "inode", "ctime_ns")
#: a temporary folder this old (a start killed while it wrote) is removed by the next entry's writer
_STALE_TMP_S = 3600.0
#: an entry no start has read for this long (another transformers since, a file long gone) is removed likewise
UNUSED_DAYS = 90


def _remove_stale_entries(root: Path, keep: str, record: dict) -> None:
    """Remove the entries made from earlier states of the same file (same conversion otherwise: another
    transformers, in another environment sharing the cache, keeps its own), entries no start has read for
    :data:`UNUSED_DAYS` days, and temporary folders that writers killed mid-way left behind."""
    same = {k: v for k, v in record.items() if k not in _FILE_STATE}
    for other in root.iterdir():
        if other.name == keep:
            continue
        if other.name.startswith("."):
            with contextlib.suppress(OSError):
                if time.time() - other.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(other, ignore_errors=True)
            continue
        try:
            unused = time.time() - (other / _SOURCE_FILE).stat().st_mtime > UNUSED_DAYS * 86400
            saved = json.loads((other / _SOURCE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if unused or isinstance(saved, dict) and {k: v for k, v in saved.items() if k not in _FILE_STATE} == same:
            shutil.rmtree(other, ignore_errors=True)
