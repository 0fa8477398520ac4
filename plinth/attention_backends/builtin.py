"""In-tree attention backends, registered through the plugin hook like any third-party one."""

from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"


@hookimpl
def plinth_attention_backends() -> dict[str, str]:
    return {
        "torch_sdpa": "plinth.attention_backends.torch_sdpa:TorchSDPABackend",
        "torch_batched": "plinth.attention_backends.torch_batched:TorchBatchedBackend",
        "cpu_paged": "plinth.attention_backends.cpu_paged:CpuPagedBackend",
        "triton": "plinth.attention_backends.triton.backend:TritonAttentionBackend",
        "flash_attn": "plinth.attention_backends.flash_attn:FlashAttnBackend",
    }
