"""Image inputs: a LLaVA-1.5-7B-shaped checkpoint (random bfloat16 weights written by transformers), run by transformers'
``LlavaForConditionalGeneration`` and by plinth on the same pixels and prompts, in one process.

    python benchmarks/multimodal.py                       # GPU: LLaVA-1.5-7B shape (CLIP-L/14 at 336, Llama-2-7B)
    python benchmarks/multimodal.py --shape tiny --device cpu --requests 8   # anywhere, small

Measured, for each system: the image encoder alone (vision tower to the layer LLaVA reads, then the projector) for
batches of images; one request (an image and ``--text-len`` text tokens, greedy, EOS ignored): the time to the first
token (a fresh image: encoded in the request) and the ms per later token (from runs of ``--max-tokens`` / 4 and
``--max-tokens`` tokens); ``--requests`` such requests at once (each its own
image), output tokens per second. transformers runs the batch with left padding in one ``generate``. Whether the
greedy tokens of the single request agree is printed (bfloat16: a near tie may part them).

Floors printed beside: a decode token streams the language model's weights once (bytes over ``--bandwidth``); an
image costs ``2 x params x positions`` FLOPs in the tower (over ``--flops``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    "llava-1.5-7b": dict(
        text=dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        image_token=32000),
    "llava-next-7b": dict(   # LLaVA-1.6 (Vicuna-7B) shape: up to 2x2 tiles of 336 and the base image
        text=dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        image_token=32000, grid=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]),
    "tiny": dict(
        text=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=56,
                    patch_size=7, projection_dim=32),
        image_token=300),
    "tiny-next": dict(
        text=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
                    patch_size=7, projection_dim=32),
        image_token=300, grid=[[28, 56], [56, 28], [56, 56]]),
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def write_checkpoint(shape: dict, path: Path, dtype: torch.dtype, device: str):
    import transformers

    text = transformers.LlamaConfig(**shape["text"], tie_word_embeddings=False)
    vision = transformers.CLIPVisionConfig(**shape["vision"])
    size = shape["vision"]["image_size"]
    common = dict(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=shape["image_token"],
                  dtype=str(dtype).removeprefix("torch."))
    if "grid" in shape:
        config = transformers.LlavaNextConfig(**common, image_grid_pinpoints=shape["grid"])
        cls = transformers.LlavaNextForConditionalGeneration
        processor = transformers.LlavaNextImageProcessor(size={"shortest_edge": size},
                                                         crop_size={"height": size, "width": size},
                                                         image_grid_pinpoints=shape["grid"])
    else:
        config = transformers.LlavaConfig(**common)
        cls = transformers.LlavaForConditionalGeneration
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                                    crop_size={"height": size, "width": size})
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    t0 = time.perf_counter()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
    return model, processor


def pictures(n: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((400, 500, 3)) * 255).astype("uint8")) for _ in range(n)]


def prompts_for(n: int, text_len: int, vocab: int, image_token: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = [int(t) for t in rng.integers(100, min(vocab, image_token) - 1, text_len)]
        out.append([1, image_token] + words)
    return out


def encoder_times(encode, pixels: torch.Tensor, batches: list[int], device: str, iters: int = 5) -> dict:
    out = {}
    for b in batches:
        x = pixels[:b]
        encode(x)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            encode(x)
        sync(device)
        out[b] = (time.perf_counter() - t0) / iters * 1e3
    return out


def hf_run(model, processor, expanded: list[list[int]], images: list, args) -> dict:
    device = args.device
    processed = processor(images=images, return_tensors="pt")
    pixels = processed["pixel_values"].to(device, model.dtype)
    sizes = processed.get("image_sizes")
    extra = (lambda k: {"image_sizes": sizes[:k].to(device)}) if sizes is not None else (lambda k: {})
    res: dict = {}
    with torch.inference_mode():
        res["encoder_ms"] = encoder_times(lambda x: model.get_image_features(pixel_values=x, **extra(len(x))),
                                          pixels, args.encoder_batches, device)

        def gen(ids_rows, pix, n):
            width = max(len(r) for r in ids_rows)
            ids = torch.tensor([[0] * (width - len(r)) + r for r in ids_rows], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids_rows], device=device)
            return model.generate(input_ids=ids, attention_mask=mask, pixel_values=pix, max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, **extra(len(pix)))

        gen(expanded[:1], pixels[:1], 4)
        gen(expanded, pixels[:len(expanded)], 4)

        def timed(n):
            sync(device)
            t0 = time.perf_counter()
            out = gen(expanded[:1], pixels[:1], n)
            sync(device)
            return (time.perf_counter() - t0) * 1e3, out

        res["ttft_ms"] = timed(1)[0]
        short, _ = timed(args.max_tokens // 4)
        total, out = timed(args.max_tokens)
        res["ms_per_token"] = (total - short) / (args.max_tokens - args.max_tokens // 4)
        res["tokens"] = out[0, len(expanded[0]):].tolist()
        t0 = time.perf_counter()
        gen(expanded, pixels[:len(expanded)], args.max_tokens)
        sync(device)
        res["batch_tok_s"] = len(expanded) * args.max_tokens / (time.perf_counter() - t0)
    return res


def plinth_run(path: Path, prompts: list[list[int]], images: list, args) -> dict:
    from plinth import LLM, SamplingParams

    llm = LLM(str(path), dtype=args.dtype, platform=args.platform, max_model_len=args.max_model_len,
              max_num_seqs=max(args.requests, 1), gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=False, seed=0, **json.loads(args.engine_kwargs))
    engine = llm.llm_engine
    res: dict = {}
    features = engine.runner.images
    prepared = [engine.images.prepare({"image": img}) for img in images]
    from plinth.multimodal.images import ImageItem

    def encode(x):   # the runner's path: the tower over every tile, each image packed
        items = [ImageItem(0, p.lengths[0], p.pixels[0], f"bench-{i}-{time.perf_counter()}", p.sizes[0])
                 for i, p in enumerate(prepared[:len(x)])]
        out = features.embeddings(items)
        features.clear()
        return out

    with torch.inference_mode():
        res["encoder_ms"] = encoder_times(encode, list(range(len(images))), args.encoder_batches, args.device)

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def reqs(k, offset=0):
        return [{"prompt_token_ids": p, "multi_modal_data": {"image": images[(i + offset) % len(images)]}}
                for i, p in enumerate(prompts[:k])]

    for k in (1, args.requests):   # warm-up (the images encoded then dropped)
        llm.generate(reqs(k, 3), params(4), use_tqdm=False)

    def timed(n):
        engine.runner.images.clear()
        sync(args.device)
        t0 = time.perf_counter()
        out = llm.generate(reqs(1), params(n), use_tqdm=False)[0]
        sync(args.device)
        return (time.perf_counter() - t0) * 1e3, out

    res["ttft_ms"] = timed(1)[0]
    short, _ = timed(args.max_tokens // 4)
    total, out = timed(args.max_tokens)
    res["ms_per_token"] = (total - short) / (args.max_tokens - args.max_tokens // 4)
    res["tokens"] = list(out.outputs[0].token_ids)
    res["expanded"] = [list(o.prompt_token_ids) for o in llm.generate(reqs(args.requests), params(1), use_tqdm=False)]
    engine.runner.images.clear()
    t0 = time.perf_counter()
    llm.generate(reqs(args.requests), params(args.max_tokens), use_tqdm=False)
    sync(args.device)
    res["batch_tok_s"] = args.requests * args.max_tokens / (time.perf_counter() - t0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llava-1.5-7b", choices=sorted(SHAPES),
                    help="llava-1.5-7b (576 positions an image) or llava-next-7b (tiles: ~2,000-2,900)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model-dir", default="/tmp/plinth-llava-bench")
    ap.add_argument("--text-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--encoder-batches", default="1,8,32")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: 2048 (LLaVA-1.5), 4096 (LLaVA-NeXT)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM nominal)")
    ap.add_argument("--flops", type=float, default=989e12, help="dense bfloat16 FLOP/s (H100 SXM nominal)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--engine-kwargs", default=None,
                    help="more LLM(...) keywords, as JSON (LLaVA-NeXT default: a token budget of 8192, above its "
                         "prompts, as session 55's figures were taken)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    args.encoder_batches = [int(b) for b in args.encoder_batches.split(",")]
    tiled = "grid" in SHAPES[args.shape]
    if args.max_model_len is None:
        args.max_model_len = 4096 if tiled else 2048
    if args.engine_kwargs is None:
        args.engine_kwargs = '{"max_num_batched_tokens": 8192}' if tiled else "{}"
    args.platform = "cpu" if args.device == "cpu" else "cuda"
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    path = Path(args.model_dir)
    model, processor = write_checkpoint(shape, path, dtype, args.device)
    images = pictures(max(args.requests, max(args.encoder_batches)))
    lm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if "vision_tower" not in n and "multi_modal_projector" not in n and "embed_tokens" not in n)
    vision = shape["vision"]
    positions = (vision["image_size"] // vision["patch_size"]) ** 2 + 1
    tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n) \
        * (vision["num_hidden_layers"] - 1) / vision["num_hidden_layers"]
    floors = {"decode_ms_per_token": lm_bytes / args.bandwidth * 1e3,
              "encoder_ms_per_tile": 2 * tower_params * positions / args.flops * 1e3}
    prompts = prompts_for(args.requests, args.text_len, shape["text"]["vocab_size"], shape["image_token"])
    model_cpu = None
    if args.skip_transformers:
        del model
    else:
        model_cpu = model
    gc.collect()
    if args.device.startswith("cuda") and model_cpu is not None:   # plinth first, with the GPU to itself
        model_cpu = model_cpu.to("cpu")
        torch.cuda.empty_cache()
    ours = plinth_run(path, prompts, images, args)
    gc.collect()   # the engine and its KV cache
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    results = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
               else "cpu", "floors": floors, "plinth": {k: v for k, v in ours.items() if k != "expanded"}}
    if model_cpu is not None:
        model = model_cpu.to(args.device)
        theirs = hf_run(model, processor, ours["expanded"], images, args)
        results["transformers"] = theirs
        results["same_tokens"] = theirs["tokens"] == ours["tokens"]
        agree = next((i for i, (a, b) in enumerate(zip(theirs["tokens"], ours["tokens"], strict=False)) if a != b),
                     len(ours["tokens"]))
        results["tokens_agree_for"] = agree
    for name in ("plinth", "transformers"):
        r = results.get(name)
        if r is None:
            continue
        enc = ", ".join(f"{b}: {ms:.2f} ms" for b, ms in r["encoder_ms"].items())
        print(f"{name:12s} encoder [{enc}]  TTFT {r['ttft_ms']:.1f} ms  decode {r['ms_per_token']:.2f} ms/token  "
              f"{args.requests} requests: {r['batch_tok_s']:.1f} output tok/s", flush=True)
    print(f"floors: decode {floors['decode_ms_per_token']:.2f} ms/token, encoder "
          f"{floors['encoder_ms_per_tile']:.3f} ms a tile (LLaVA: an image; LLaVA-NeXT: up to 5 an image)",
          flush=True)
    if "same_tokens" in results:
        print(f"greedy tokens agree for the first {results['tokens_agree_for']} of {args.max_tokens}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
