"""Helpers for the server tests: a tiny random Llama with a trained tokenizer, and real server processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: ( ) [ ] { } < > = + - * / .",
    "A language model predicts the next token from the tokens before it.",
    "once upon a time there was a small server that answered every request",
]


def make_tiny_model(path: Path, *, max_position_embeddings: int = 4096, seed: int = 0,
                    added_tokens: Sequence[str] = ()) -> Path:
    """Save a 2-layer random Llama and a byte-level BPE tokenizer (ChatML template) into ``path``;
    ``added_tokens``: plain (not special) single tokens the tokenizer gets, such as ``<think>``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = CHATML
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    tok.save_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        eos_token_id=eos, bos_token_id=None, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        initializer_range=0.3, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real ``plinth serve`` process on 127.0.0.1 (its log goes to a temporary file)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout_s: float = 120.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="plinth-serve-", suffix=".log", delete=False)  # noqa: SIM115
        full_env = dict(os.environ, **(env or {}))
        full_env.setdefault("PLINTH_DISABLE_PLUGIN_AUTOLOAD", "1")
        cmd = [sys.executable, "-m", "plinth.entrypoints.cli", "serve", *args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


@contextlib.contextmanager
def running_server(args: list[str], env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    server = ServerProcess(args, env)
    try:
        yield server
    finally:
        server.stop()


def scrape_metrics(base_url: str, client=None) -> dict[str, float]:
    """``/metrics`` (of ``base_url``, or through a test ``client``) as {sample name with labels: value} (labels
    sorted, model_name dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (client.get("/metrics") if client is not None else httpx.get(f"{base_url}/metrics", timeout=10.0)).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            samples[key] = s.value
    return samples
