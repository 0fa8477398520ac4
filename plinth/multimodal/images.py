"""Image inputs on the engine's side: decoding, the checkpoint's image processor, and the prompt's placeholders.

A prompt names each image with the model's image token (``<image>`` for LLaVA): one token, which
:meth:`ImageSupport.expand` widens to the positions the image's embeddings fill (the same for every image of a
LLaVA model; by the image's size for LLaVA-NeXT), or a run of exactly that many (a prompt already expanded). Each image becomes an :class:`ImageItem`: its pixels, the
positions it fills, and a digest of its pixels that the prefix cache keys its blocks with (two images never share
cached blocks, the same image in two prompts does).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plinth.core.scheduler import RequestRejectedError
from plinth.errors import ModelLoadError

logger = logging.getLogger(__name__)

#: the most images one request may carry (vLLM's ``--limit-mm-per-prompt`` default is larger; one prompt's images
#: must fit its context anyway)
MAX_IMAGES_PER_PROMPT = 16
#: the most videos a prompt may carry unless ``--limit-mm-per-prompt`` says otherwise
MAX_VIDEOS_PER_PROMPT = 4
#: the largest image (pixels) decoded: PIL's own decompression-bomb limit
MAX_IMAGE_PIXELS = 89_478_485
#: the most elongated image taken (long side over short side): processors scale the short side up to the tower's
#: size, so a thin strip of a few pixels would become a huge array
MAX_ASPECT_RATIO = 100


_POOL: Any = None


def media_pool() -> Any:
    """The threads that decode, read, fetch and process images for the async front and the server: their own pool,
    so that slow image sources never hold up the default executor's work (tokenizing, replies)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="plinth-media")
    return _POOL


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """Where images named by URL may come from besides data URLs (vLLM's ``--allowed-local-media-path`` and
    ``--allowed-media-domains``; plinth fetches nothing unless told).

    Attributes:
        local_path: ``file://`` URLs are read from under this directory (``None``: refused).
        domains: ``http(s)://`` URLs are fetched from these hosts and their subdomains (``*``: any host; empty:
            refused). A redirect must stay within them.
        timeout_s: the most seconds a fetch may take.
        max_bytes: the largest image file read or fetched.
    """

    local_path: str | None = None
    domains: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_bytes: int = 32 << 20

    def allows_host(self, host: str | None) -> bool:
        host = (host or "").lower().rstrip(".")
        return bool(host) and any(d == "*" or host == d or host.endswith("." + d) for d in self.domains)


@dataclasses.dataclass(eq=False)
class ImageItem:
    """One image of a request.

    Attributes:
        offset: the prompt position of its first placeholder.
        length: how many positions its embeddings fill.
        pixel_values: ``[tiles, C, S, S]`` float32, as the image processor made them (one tile for LLaVA).
        key: a digest of ``pixel_values`` and ``image_size`` (the prefix cache's and the encoder cache's key).
        image_size: the image's (height, width) before processing (LLaVA-NeXT packs its tiles by it).
        grid: Qwen2-VL: the image's (time, height, width) in patches (its ``pixel_values`` are ``[t * h * w,
            C * T * P * P]`` patches); else ``None``.
        rope: Qwen2-VL: its positions' ``[length, 3]`` multimodal RoPE positions (:mod:`plinth.multimodal.mrope`).
        embeds: an image given as its embeddings (``[length, hidden]``, :class:`EmbeddedImage`): not encoded, and
            ``pixel_values`` is empty; else ``None``.
        time_scale: a Qwen2.5-VL video's ``(seconds a frame group, rotary time positions a second)``; else ``None``
            (one time position a frame group; see :func:`plinth.multimodal.mrope.image_positions`).
    """

    offset: int
    length: int
    pixel_values: torch.Tensor
    key: str
    image_size: tuple[int, int] | None = None
    grid: tuple[int, int, int] | None = None
    rope: Any = None
    embeds: torch.Tensor | None = None
    time_scale: tuple[float, float] | None = None
    #: Mistral 3: which positions of its span take its embeddings (``[length]`` bool; the row breaks and the end
    #: token keep their own); ``None``: all of them
    mask: Any = None
    #: rows of a prompt given as embeddings (:mod:`plinth.core.prompt_embeds`), not an image: attended causally, as
    #: text, and without DeepStack rows
    prompt: bool = False

    @property
    def embedded(self) -> int:
        """How many of its positions take its embeddings."""
        return self.length if self.mask is None else int(self.mask.sum())

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_key_extra(items: Sequence[ImageItem], start: int, end: int) -> tuple[Any, ...]:
    """What the prefix cache adds to the key of a block of positions ``[start, end)``: each image overlapping it
    (its digest and where the block starts within it); ``()`` for a block without images."""
    return tuple((item.key, start - item.offset) for item in items if item.offset < end and start < item.end)


def check_size(width: int, height: int, where: str) -> None:
    """Refuse an image too large (:data:`MAX_IMAGE_PIXELS`), empty, or too elongated (:data:`MAX_ASPECT_RATIO`).

    Raises:
        RequestRejectedError: as above.
    """
    if width * height > MAX_IMAGE_PIXELS:
        raise RequestRejectedError(f"{where}: {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS} allowed")
    if min(width, height) < 1:
        raise RequestRejectedError(f"{where}: an empty image ({width}x{height})")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise RequestRejectedError(f"{where}: {width}x{height} pixels, longer than {MAX_ASPECT_RATIO} times its width")


def decode_image(data: bytes, where: str = "image") -> Any:
    """A PIL image (RGB) from encoded bytes (PNG, JPEG, WebP, ...).

    Raises:
        RequestRejectedError: not an image PIL can read, or larger than :data:`MAX_IMAGE_PIXELS`.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            check_size(img.width, img.height, where)
            img.load()
            return _rgb(img)
    except RequestRejectedError:
        raise
    except Exception as exc:   # noqa: BLE001 - PIL raises many kinds for a bad file
        raise RequestRejectedError(f"{where} cannot be read as an image: {type(exc).__name__}: {exc}") from None


def image_from_url(url: str, where: str = "image_url", policy: MediaPolicy | None = None) -> Any:
    """A PIL image from a ``data:image/...;base64,...`` URL, or, where ``policy`` allows, a ``file://`` URL under
    its directory or an ``http(s)://`` URL of its domains.

    Raises:
        RequestRejectedError: a URL the policy does not allow, bad base64, a failed fetch, or bytes that are not an
            image.
    """
    return decode_image(media_bytes(url, where, policy, "image"), where)


def media_bytes(url: str, where: str, policy: MediaPolicy | None, kind: str) -> bytes:
    """The bytes of a ``data:<kind>/...;base64,...`` URL, or, where ``policy`` allows, of a ``file://`` URL under its
    directory or an ``http(s)://`` URL of its domains (``kind``: ``"image"`` or ``"video"``).

    Raises:
        RequestRejectedError: a URL the policy does not allow, a data URL of another media type, bad base64, a
            failed fetch.
    """
    if not isinstance(url, str):
        raise RequestRejectedError(f"{where} must be a string URL, got {type(url).__name__}")
    policy = policy or MediaPolicy()
    if url[:8].lower().startswith(("http://", "https://")):
        return fetch_url(url, policy, where)
    if url[:7].lower() == "file://":
        return read_local(url, policy, where)
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:20]
        example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
        raise RequestRejectedError(f"{where}: a {scheme!r} URL; {kind}s come as data: URLs ({example}), or "
                                   "http(s):// and file:// URLs where the server allows them")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise RequestRejectedError(f"{where}: a data URL must be data:<media type>;base64,<data>")
    if not header.startswith(f"{kind}/"):
        raise RequestRejectedError(f"{where}: the data URL's media type is {header[:-7] or 'missing'!r}, not "
                                   f"{'an image' if kind == 'image' else 'a video'}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestRejectedError(f"{where}: the data URL's payload is not valid base64") from None


def fetch_url(url: str, policy: MediaPolicy, where: str = "image_url") -> bytes:
    """The bytes at an ``http(s)`` URL of one of the policy's domains (each redirect checked too).

    Raises:
        RequestRejectedError: a host the policy does not allow, a failed or slow fetch, or a file too large.
    """
    import urllib.error
    import urllib.parse
    import urllib.request

    host = urllib.parse.urlsplit(url).hostname
    if not policy.domains:
        raise RequestRejectedError(f"{where}: the server fetches no image URLs; send the image inline as a data: URL "
                                   "(or start the server with --allowed-media-domains)")
    if not policy.allows_host(host):
        raise RequestRejectedError(f"{where}: host {host!r} is not among the allowed media domains "
                                   f"({', '.join(policy.domains)})")

    import http.client
    import socket
    import threading

    sockets: list[socket.socket] = []   # every connection the fetch opens (a redirect opens another)
    expired = threading.Event()

    def watched(base: type) -> Any:
        class Connection(base):   # type: ignore[valid-type, misc]
            def connect(self) -> None:
                super().connect()
                sockets.append(self.sock)
                if expired.is_set():
                    self.sock.close()
        return Connection

    class _Http(urllib.request.HTTPHandler):
        def http_open(self, req):  # type: ignore[no-untyped-def]
            return self.do_open(watched(http.client.HTTPConnection), req)

    class _Https(urllib.request.HTTPSHandler):
        def https_open(self, req):  # type: ignore[no-untyped-def]
            return self.do_open(watched(http.client.HTTPSConnection), req, context=self._context)

    class _Checked(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
            target = urllib.parse.urlsplit(newurl)
            if target.scheme not in ("http", "https") or not policy.allows_host(target.hostname):
                raise RequestRejectedError(f"{where}: redirected to {target.hostname!r}, outside the allowed media "
                                           "domains")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    def expire() -> None:   # the whole fetch's deadline: headers, redirects and body (each read has its own timeout)
        expired.set()
        for sock in list(sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    too_slow = f"{where}: fetching the image took more than {policy.timeout_s:g} s"
    timer = threading.Timer(policy.timeout_s, expire)
    timer.daemon = True
    timer.start()
    opener = urllib.request.build_opener(_Http, _Https, _Checked)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "plinth"}),
                         timeout=policy.timeout_s) as response:
            chunks: list[bytes] = []
            size = 0
            while size <= policy.max_bytes:   # (past the deadline the watchdog's shutdown ends the reads)
                chunk = response.read1(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            data = b"".join(chunks)
    except RequestRejectedError:
        raise
    except urllib.error.HTTPError as exc:
        raise RequestRejectedError(f"{where}: fetching the image gave HTTP {exc.code}") from None
    except Exception as exc:   # noqa: BLE001 - URLError, timeouts, http.client's protocol errors, bad URLs
        if expired.is_set():
            raise RequestRejectedError(too_slow) from None
        reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
        raise RequestRejectedError(f"{where}: cannot fetch the image: {reason}") from None
    finally:
        timer.cancel()
    if expired.is_set():   # (a body cut short by the deadline reads as its end)
        raise RequestRejectedError(too_slow)
    if len(data) > policy.max_bytes:
        raise RequestRejectedError(f"{where}: the image is larger than {policy.max_bytes} bytes")
    return data


def read_local(url: str, policy: MediaPolicy, where: str = "image_url") -> bytes:
    """The bytes of a ``file://`` URL's file, which must lie under the policy's directory.

    Raises:
        RequestRejectedError: no directory allowed, a path outside it, no such file, or a file too large.
    """
    import urllib.parse

    if policy.local_path is None:
        raise RequestRejectedError(f"{where}: file:// URLs are not allowed (start the server with "
                                   "--allowed-local-media-path DIR to read images from under DIR)")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestRejectedError(f"{where}: a file:// URL names a local path (file:///path), not host "
                                   f"{parts.netloc!r}")
    try:
        root = Path(policy.local_path).resolve()
        path = Path(urllib.parse.unquote(parts.path)).resolve()
        if not path.is_relative_to(root):
            raise RequestRejectedError(f"{where}: {path} is outside the allowed local media path {root}")
        if not path.is_file():
            raise RequestRejectedError(f"{where}: no such file {path}")
        with path.open("rb") as f:
            data = f.read(policy.max_bytes + 1)
    except RequestRejectedError:
        raise
    except (OSError, ValueError) as exc:   # a NUL byte, a name too long, no permission
        raise RequestRejectedError(f"{where}: cannot read the file: {type(exc).__name__}: {exc}") from None
    if len(data) > policy.max_bytes:
        raise RequestRejectedError(f"{where}: {path} is larger than {policy.max_bytes} bytes")
    return data


def _rgb(image: Any) -> Any:
    """``image`` in RGB as transformers' processors make it: any other mode through RGBA, put over white (so
    transparent pixels are white, not their hidden colour)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def _as_pil(image: Any, where: str) -> Any:
    from PIL import Image

    if isinstance(image, Image.Image):
        check_size(image.width, image.height, where)
        try:   # (an image opened lazily is read here: a truncated file fails now)
            return _rgb(image)
        except Exception as exc:   # noqa: BLE001 - PIL raises many kinds for a bad file or a mode it cannot convert
            raise RequestRejectedError(f"{where} cannot be read as an image: {type(exc).__name__}: {exc}") from None
    if isinstance(image, bytes | bytearray):
        return decode_image(bytes(image), where)
    raise RequestRejectedError(f"{where} must be a PIL image or an image file's bytes, got {type(image).__name__}")


class ImageSupport:
    """A LLaVA checkpoint's image side for the engine: the image processor, the placeholder token and how many
    positions an image fills.

    Args:
        mm_config: the checkpoint's ``LlavaConfig``.
        path: the model directory (its ``preprocessor_config.json``, if any, configures the processor).
        tokenizer: the model's (the image token's text, which chat messages' image parts become).
        limit: the most images a prompt may carry (``--limit-mm-per-prompt``).
        policy: where images named by URL may come from (:class:`MediaPolicy`).
        processor_kwargs: settings of the image processor (``mm_processor_kwargs``; see :func:`_apply_settings`).
        dtype: the model's (images given as embeddings are kept in it, and must be finite in it; processed pixels
            are kept in it).
        video_limit: the most videos a prompt may carry (Qwen2-VL).
    """

    def __init__(self, mm_config: Any, path: str | None, tokenizer: Any = None,
                 limit: int = MAX_IMAGES_PER_PROMPT, policy: MediaPolicy | None = None,
                 processor_kwargs: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
                 video_limit: int = MAX_VIDEOS_PER_PROMPT):
        from plinth.multimodal.gemma3 import PromptLayout, is_gemma3
        from plinth.multimodal.idefics3 import is_idefics3
        from plinth.multimodal.internvl import is_internvl
        from plinth.multimodal.llama4 import is_llama4
        from plinth.multimodal.pixtral import is_pixtral
        from plinth.multimodal.qwen_vision import is_qwen_vl
        from plinth.multimodal.vision import check_layout, is_next, tokens_per_image

        #: Qwen2-VL / Qwen2.5-VL: images of any size as patches, multimodal RoPE positions
        self.qwen = is_qwen_vl(mm_config)
        #: Mistral 3 (Pixtral): images at their own size, rows of image tokens with break tokens between
        self.pixtral = is_pixtral(mm_config)
        #: Idefics3 / SmolVLM: an image as tiles and a global view, its prompt laid out by its tiles (the tokenizer's
        #: tokens for it, :class:`~plinth.multimodal.idefics3.PromptTokens`); else ``None``
        self.tiles: Any = None
        #: InternVL: an image as tiles and a thumbnail between <img> and </img>
        self.internvl = is_internvl(mm_config)
        #: Llama 4: an image as tiles and a global view, its prompt's placeholder <|image|>, its patches the image token
        self.llama4 = is_llama4(mm_config)
        if is_idefics3(mm_config) or self.internvl or self.llama4:
            if self.internvl:
                from plinth.multimodal.internvl import PromptTokens
            elif self.llama4:
                from plinth.multimodal.llama4 import PromptTokens
            else:
                from plinth.multimodal.idefics3 import PromptTokens
            try:
                self.tiles = PromptTokens(mm_config, tokenizer) if tokenizer is not None else None
            except ValueError as exc:
                logger.warning("this checkpoint's tokenizer cannot lay images out (%s): its images are refused", exc)
        #: a prompt's image is laid out by the image (Mistral 3, Idefics3 / SmolVLM, InternVL, Llama 4): each placeholder names
        #: one image
        self.patterned = self.pixtral or is_idefics3(mm_config) or self.internvl or self.llama4
        #: Gemma 3: how its prompt lays out an image (the ``<start_of_image>`` a prompt carries widened); else ``None``
        self.layout: Any = None
        if is_gemma3(mm_config):
            self.layout = PromptLayout(mm_config, tokenizer)
        if not self.qwen and not self.patterned:
            check_layout(mm_config)
        self.token_id = int(mm_config.image_token_index if getattr(mm_config, "image_token_index", None) is not None
                            else mm_config.image_token_id)
        #: the token of the positions that take an image's embeddings (Llama 4: its patches'; the others: the image
        #: token itself)
        self.embedding_token = self.token_id
        if self.llama4:   # (a prompt names an image by <|image|>; the laid-out patches are the image token)
            self.token_id = self.tiles.placeholder if self.tiles is not None else -1
        self.mm_config = mm_config
        self.tiled = is_next(mm_config)
        #: positions an image fills (LLaVA-NeXT, Qwen2-VL: ``None``, it depends on the image's size)
        self.tokens_per_image: int | None = (None if self.tiled or self.qwen or self.patterned
                                             else tokens_per_image(mm_config))
        from plinth.multimodal.internvl import square_size

        self.image_size = None if self.qwen or self.pixtral else square_size(mm_config.vision_config.image_size)
        self.merge = int(getattr(mm_config.vision_config, "spatial_merge_size", 1))
        self.processor = _image_processor(mm_config, path)
        if self.internvl:   # (InternVLProcessor cuts images into tiles whatever its image processor's config says)
            self.processor.crop_to_patches = True
        if self.layout is not None:
            # (Gemma 3: transformers' Gemma3Processor passes its own pan-and-scan defaults whatever the image processor's
            # config says, so only mm_processor_kwargs turn the crops on)
            from plinth.multimodal.gemma3 import PAN_AND_SCAN_DEFAULTS

            for key, value in PAN_AND_SCAN_DEFAULTS.items():
                setattr(self.processor, key, value)
        if processor_kwargs:
            _apply_settings(self.processor, processor_kwargs, self.qwen, tile_settings(mm_config))
        self.limit = limit
        self.dtype = dtype
        self.policy = policy or MediaPolicy()
        self.path = path
        self.processor_kwargs = processor_kwargs
        #: Qwen2-VL: the video token and how videos become patches (:mod:`plinth.multimodal.video`); else ``None``
        self.video_token_id: int | None = None
        self.video: Any = None
        self.video_limit = video_limit
        vocab = int(getattr(getattr(mm_config, "text_config", mm_config), "vocab_size", 0) or 0)
        video_id = getattr(mm_config, "video_token_id", None) if self.qwen else None
        #: the model's tokenizer (Qwen3-VL: the frame groups' times are written in the prompt as text)
        self.tokenizer = tokenizer
        #: the most positions a prompt may fill (the engine's ``max_model_len``): a video that fills more is refused
        #: before its patches are made; ``None``: no bound
        self.max_positions: int | None = None
        if video_id is not None and 0 <= int(video_id) < (vocab or int(video_id) + 1):
            from plinth.multimodal.video import video_settings

            self.video_token_id = int(video_id)
            self.video = video_settings(mm_config, path, processor_kwargs)
        token = tokenizer.convert_ids_to_tokens(self.token_id) if tokenizer is not None and self.token_id >= 0 else None
        #: the image token as text (a chat message's image part, as a template that reads strings sees it; Qwen2-VL's
        #: between its vision start and end tokens)
        self.placeholder: str = token if isinstance(token, str) else "<image>"
        #: Mistral 3: the row-break and end tokens of an image's prompt
        self.break_ids: tuple[int, int] | None = None
        if self.pixtral:
            ids = [tokenizer.convert_tokens_to_ids(t) if tokenizer is not None else None
                   for t in ("[IMG_BREAK]", "[IMG_END]")]
            if all(isinstance(i, int) and i >= 0 and i != getattr(tokenizer, "unk_token_id", None) for i in ids):
                self.break_ids = (int(ids[0]), int(ids[1]))
            else:   # (text prompts still run; images are refused, see _pixtral_pictures)
                logger.warning("this Mistral 3 checkpoint's tokenizer lacks [IMG_BREAK] / [IMG_END]: its images are "
                               "refused")
        if self.layout is not None:   # (Gemma 3: a prompt names an image by its <start_of_image>)
            begin = tokenizer.convert_ids_to_tokens(self.layout.begin) if tokenizer is not None else None
            self.placeholder = begin if isinstance(begin, str) else "<start_of_image>"
        #: the video token as text, likewise (a model that takes videos; else ``None``)
        self.video_placeholder: str | None = None
        if self.video_token_id is not None and tokenizer is not None:
            video = tokenizer.convert_ids_to_tokens(self.video_token_id)
            self.video_placeholder = video if isinstance(video, str) else None
        if self.qwen and tokenizer is not None:
            ends = [tokenizer.convert_ids_to_tokens(getattr(mm_config, key, None))
                    if getattr(mm_config, key, None) is not None else None
                    for key in ("vision_start_token_id", "vision_end_token_id")]
            if all(isinstance(t, str) for t in ends):
                self.placeholder = f"{ends[0]}{self.placeholder}{ends[1]}"
                if self.video_placeholder is not None:
                    self.video_placeholder = f"{ends[0]}{self.video_placeholder}{ends[1]}"

    def pixel_values(self, images: Sequence[Any], processor: Any = None) -> list[torch.Tensor]:
        """Each PIL image's ``[tiles, C, S, S]`` float32 pixels, as the checkpoint's processor makes them (one tile
        for LLaVA; LLaVA-NeXT's processor pads every image to the most tiles, cut back to the image's own here).

        Raises:
            RequestRejectedError: the processor cannot take an image.
        """
        from plinth.multimodal.vision import num_tiles

        try:
            out = (processor or self.processor)(images=list(images), return_tensors="pt")["pixel_values"]
        except Exception as exc:   # noqa: BLE001 - a processor's failure on one odd image
            raise RequestRejectedError(f"the image processor cannot take this image: {type(exc).__name__}: "
                                       f"{exc}", param="multi_modal_data") from None
        if out.dim() == 4:
            out = out[:, None]
        if out.dim() != 5 or out.shape[-2:] != (self.image_size, self.image_size):
            raise RequestRejectedError(f"the image processor made images of shape {tuple(out.shape)}; the vision "
                                       f"tower takes {self.image_size}x{self.image_size}", param="multi_modal_data")
        # (copies: a view would carry the whole batch's pixels wherever one image goes, e.g. to worker processes)
        return [out[i, :num_tiles(self.mm_config, (img.height, img.width))].clone().float()
                for i, img in enumerate(images)]

    def patches(self, images: Sequence[Any], processor: Any = None,
                ) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """Qwen2-VL: each PIL image's ``[t * h * w, C * T * P * P]`` float32 patches and its (t, h, w) grid, as the
        checkpoint's processor makes them (resized to a multiple of the merged patch, within its pixel limits).

        Raises:
            RequestRejectedError: the processor cannot take an image.
        """
        try:
            out = (processor or self.processor)(images=list(images), return_tensors="pt")
            pixels, grids = out["pixel_values"], [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        except Exception as exc:   # noqa: BLE001 - a processor's failure on one odd image
            raise RequestRejectedError(f"the image processor cannot take this image: {type(exc).__name__}: "
                                       f"{exc}", param="multi_modal_data") from None
        counts = [t * h * w for t, h, w in grids]
        if len(grids) != len(images) or sum(counts) != pixels.shape[0] or any(
                h % self.merge or w % self.merge for _, h, w in grids):
            raise RequestRejectedError(f"the image processor made {pixels.shape[0]} patches in grids {grids}, which "
                                       f"do not fit the vision tower (merges of {self.merge}x{self.merge})",
                                       param="multi_modal_data")
        return [p.clone().float() for p in pixels.split(counts)], grids

    def pattern_of(self, image: Any) -> tuple[int, ...] | None:
        """Mistral 3: a PIL image's prompt tokens (its rows of image tokens and breaks, from its size alone);
        Idefics3 / SmolVLM: its tiles' and global view's; the other models: ``None`` (the placeholder repeated)."""
        if not self.patterned or isinstance(image, EmbeddedImage):
            return None
        if not self.pixtral:
            from plinth.multimodal.idefics3 import grid_of

            try:
                grid = ((int(self.processor.get_number_of_image_patches(image.height, image.width, {})),)
                        if self.internvl else self.processor.grid(image.height, image.width) if self.llama4
                        else grid_of(self.processor, (image.height, image.width)))
            except (KeyError, TypeError, ValueError, AttributeError):   # a processor of other settings: run it
                return self._tiled_pictures([image]).patterns[0]
            if self.tiles is None:
                return self._tiled_pictures([image]).patterns[0]   # (refuses it)
            return tuple(self.tiles.layout(*grid))
        from plinth.multimodal.pixtral import grid_of, layout

        try:
            rows, cols = grid_of(self.mm_config, self.processor, (image.height, image.width))
        except (KeyError, TypeError, ValueError, AttributeError):   # a processor of other settings: run it
            return self._pixtral_pictures([image]).patterns[0]
        if self.break_ids is None:
            return self._pixtral_pictures([image]).patterns[0]   # (refuses it)
        return tuple(layout(rows, cols, self.token_id, *self.break_ids))

    def parts(self, loaded: dict[str, Any] | None = None, load: bool = True) -> ImageParts:
        """A conversation's collector of image (and video) content parts for this model (its placeholders, media
        policy and limits)."""
        return ImageParts(self.placeholder, self.policy, loaded, load, self.limit, self.video_placeholder,
                          self.video_limit, self.video_sampler)

    @property
    def video_sampler(self) -> Any:
        """How a video file's frames are chosen (:func:`~plinth.multimodal.video.file_sampler`)."""
        from plinth.multimodal.video import file_sampler

        return file_sampler(self.video)

    def crops_of(self, images: Sequence[Any]) -> list[int]:
        """Each image's pan-and-scan crops (Gemma 3 with ``do_pan_and_scan``; 0 for the others and for images given
        as embeddings)."""
        if self.layout is None or not getattr(self.processor, "do_pan_and_scan", False):
            return [0] * len(images)
        from plinth.multimodal.gemma3 import crop_count

        return [0 if isinstance(m, EmbeddedImage) else crop_count(m.height, m.width, self.processor) for m in images]

    def length_of(self, image: Any) -> int:
        """The positions a PIL image (or an :class:`EmbeddedImage`, or a video) fills."""
        from plinth.multimodal.video import Video, length_of
        from plinth.multimodal.vision import tokens_per_image

        if isinstance(image, Video):   # (Qwen3-VL's videos: see laid_out, which writes their frame groups' times)
            return length_of(self.video, image)
        if self.patterned and not isinstance(image, EmbeddedImage):
            return len(self.pattern_of(image) or ())

        if isinstance(image, EmbeddedImage):
            return len(image.embeds)
        if self.qwen:
            return self._qwen_length(image)
        return self.tokens_per_image or tokens_per_image(self.mm_config, (image.height, image.width))

    def _qwen_length(self, image: Any) -> int:
        """Qwen2-VL: the positions of a PIL image from its size, as the processor resizes it (without making the
        patches: the server counts positions on its event loop); the processor itself where it is not transformers'
        usual one."""
        proc = self.processor
        size = getattr(proc, "size", None)
        try:
            patch, merge = int(proc.patch_size), int(proc.merge_size)
            low, high = int(size["shortest_edge"]), int(size["longest_edge"])
        except (AttributeError, KeyError, TypeError, ValueError):
            (t, h, w), = self.patches([image])[1]
            return t * h * w // (self.merge * self.merge)
        height, width = image.height, image.width
        if getattr(proc, "do_resize", True):
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            try:
                height, width = smart_resize(height, width, factor=patch * merge, min_pixels=low, max_pixels=high)
            except ValueError as exc:
                raise RequestRejectedError(f"the image processor cannot take this image: {exc}",
                                           param="multi_modal_data") from None
        elif height % (patch * merge) or width % (patch * merge):   # (the processor would refuse it)
            raise RequestRejectedError(f"the image processor does not resize images, and a {width}x{height} image "
                                       f"is not made of whole {patch * merge}-pixel squares", param="multi_modal_data")
        return (height // patch) * (width // patch) // (merge * merge)

    def images_of(self, data: Any) -> list[Any]:
        """The PIL images of a request's ``multi_modal_data`` (``{"image": image or [images]}``).

        Raises:
            RequestRejectedError: another shape, another modality, too many images, or an unreadable one.
        """
        if not isinstance(data, dict):
            raise RequestRejectedError(f"multi_modal_data must be a dict such as {{'image': image}}, got "
                                       f"{type(data).__name__}", param="multi_modal_data")
        taken = ("image", "video") if self.video is not None else ("image",)
        other = sorted(str(k) for k in data if k not in taken)
        if other:
            raise RequestRejectedError(f"multi_modal_data: this model takes {' and '.join(t + 's' for t in taken)} "
                                       f"only, got {', '.join(other)}", param="multi_modal_data")
        images = data.get("image", [])
        images = list(images) if isinstance(images, list | tuple) else [images]
        if len(images) > self.limit:
            raise RequestRejectedError(f"multi_modal_data: {len(images)} images, at most {self.limit} a prompt "
                                       "(--limit-mm-per-prompt)", param="multi_modal_data")
        return [self._embedded(img, f"multi_modal_data image {i}") if isinstance(img, torch.Tensor | dict)
                else _as_pil(img, f"multi_modal_data image {i}") for i, img in enumerate(images)]

    def _embedded(self, value: Any, where: str) -> EmbeddedImage:
        """An image given as its embeddings: a ``[positions, hidden]`` tensor (LLaVA; ``[1, positions, hidden]``
        too), or ``{"image_embeds": tensor, "image_grid_thw": (t, h, w)}`` (Qwen2-VL: the grid its positions come
        from), as the vision encoder and projector would make them.

        Raises:
            RequestRejectedError: another shape, a hidden size not the language model's, a count of positions the
                model's images do not have, or values that are not finite.
        """
        grid = None
        if self.patterned:
            raise RequestRejectedError(f"{where}: this model takes images as pictures, not embeddings (an image's "
                                       "prompt is laid out by its rows or tiles)", param="multi_modal_data")
        if isinstance(value, dict):
            unknown = sorted(str(k) for k in value if k not in ("image_embeds", "image_grid_thw"))
            if unknown or "image_embeds" not in value:
                raise RequestRejectedError(f"{where}: an image given as embeddings is a tensor or a dict with "
                                           f"'image_embeds' (and, for Qwen2-VL, 'image_grid_thw'); got keys "
                                           f"{sorted(map(str, value))}", param="multi_modal_data")
            grid, value = value.get("image_grid_thw"), value["image_embeds"]
        if not isinstance(value, torch.Tensor) or value.dtype not in (torch.float32, torch.float16, torch.bfloat16,
                                                                       torch.float64) \
                or value.layout != torch.strided or value.is_meta:
            raise RequestRejectedError(f"{where}: image embeddings must be a dense float32, float16, bfloat16 or "
                                       "float64 tensor", param="multi_modal_data")
        embeds = value.detach()
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        from plinth.multimodal.qwen_vision import deepstack_count

        # (Qwen3-VL: the main embeddings, then each DeepStack merger's, side by side, as its encoder makes them)
        hidden = int(self.mm_config.text_config.hidden_size) * (1 + deepstack_count(self.mm_config))
        if embeds.dim() != 2 or embeds.shape[1] != hidden or embeds.shape[0] < 1:
            raise RequestRejectedError(f"{where}: image embeddings of shape {tuple(value.shape)}; this model takes "
                                       f"[positions, {hidden}]", param="multi_modal_data")
        rows = int(embeds.shape[0])
        if self.qwen:
            try:
                grid = tuple(int(v) for v in torch.as_tensor(grid).reshape(-1).tolist()) if grid is not None else None
            except (TypeError, ValueError, RuntimeError):
                grid = None
            m = self.merge
            if grid is None or len(grid) != 3 or min(grid) < 1 or grid[1] % m or grid[2] % m:
                raise RequestRejectedError(f"{where}: Qwen2-VL image embeddings need 'image_grid_thw', the image's "
                                           f"(t, h, w) in patches (h and w multiples of {m})", param="multi_modal_data")
            if grid[0] * grid[1] * grid[2] // (m * m) != rows:
                raise RequestRejectedError(f"{where}: a grid of {grid} patches is {grid[0] * grid[1] * grid[2] // (m * m)}"
                                           f" positions, the embeddings have {rows}", param="multi_modal_data")
        elif grid is not None:
            raise RequestRejectedError(f"{where}: 'image_grid_thw' is for Qwen2-VL models", param="multi_modal_data")
        elif self.tokens_per_image is not None and rows != self.tokens_per_image:
            raise RequestRejectedError(f"{where}: {rows} positions of image embeddings; this model's images fill "
                                       f"{self.tokens_per_image}", param="multi_modal_data")
        # (a copy on the CPU in the model's dtype: the caller's tensor may change or live on a device)
        embeds = embeds.to("cpu", self.dtype, copy=True).contiguous()
        if not bool(torch.isfinite(embeds).all()):
            raise RequestRejectedError(f"{where}: image embeddings with values that are not finite in the model's "
                                       f"{str(self.dtype).removeprefix('torch.')}", param="multi_modal_data")
        return EmbeddedImage(embeds, grid)

    def expand(self, ids: Sequence[int], lengths: Sequence[int], tokens: Sequence[int] = (),
               patterns: Sequence[Sequence[int] | None] = ()) -> tuple[list[int], list[tuple[int, int]]]:
        """The prompt with each image's placeholder widened to the positions the image fills (``lengths``, one per
        entry), and each entry's ``(offset, length)``, in the entries' order. ``tokens``: each entry's placeholder
        token (Qwen2-VL's videos take the video token; default: every entry an image). The entries of a token take
        its placeholders in order. A run of a placeholder token is entries already widened where it holds exactly
        their lengths, else one entry per token (``<image><image>``).

        Raises:
            RequestRejectedError: the prompt's placeholders of a token do not name as many entries as it has.
        """
        kinds = list(tokens) or [self.token_id] * len(lengths)
        queues: dict[int, list[int]] = {self.token_id: []}
        if self.video_token_id is not None:
            queues[self.video_token_id] = []
        for i, token in enumerate(kinds):
            queues.setdefault(token, []).append(i)
        named = dict.fromkeys(queues, 0)
        spans: list[tuple[int, int]] = [(0, 0)] * len(lengths)
        out: list[int] = []
        i = 0
        while i < len(ids):
            token = ids[i]
            if token not in queues:
                out.append(token)
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            mine, k = [lengths[e] for e in queues[token]], named[token]
            what = "video" if token == self.video_token_id else "image"
            # (Mistral 3: each placeholder one image, adjacent ones too: a widened image is never one run)
            widths = ([mine[k + r] if k + r < len(mine) else 1 for r in range(j - i)] if self.patterned
                      else self._widths(j - i, mine, k, token, what))
            for n in widths:
                pattern = None
                if k < len(mine):
                    spans[queues[token][k]] = (len(out), n)
                    pattern = patterns[queues[token][k]] if patterns else None
                k += 1
                out.extend(pattern if pattern is not None else [token] * n)
            named[token] = k
            i = j
        for token, entries in queues.items():
            if named[token] != len(entries):
                what = "video" if token == self.video_token_id else "image"
                crops = (" (with pan-and-scan on, each crop counts as an image: lay the crops out as the processor "
                         "does, or give one <start_of_image> for each image)"
                         if self.layout is not None and getattr(self.processor, "do_pan_and_scan", False) else "")
                raise RequestRejectedError(
                    f"the prompt names {named[token]} {what}(s) ({what} token id {token}) but multi_modal_data has "
                    f"{len(entries)}: put one {what} token where each {what} goes{crops}", param="multi_modal_data")
        return out, spans

    @staticmethod
    def _widths(run: int, lengths: Sequence[int], k: int, token: int, what: str) -> list[int]:
        """The widths of the entries a run of ``run`` placeholder tokens names, its first the ``k``-th of
        ``lengths`` (a width 1 for each placeholder past the entries)."""
        if run == 1 or k >= len(lengths):
            return [lengths[k]] if k < len(lengths) else [1] * run
        taken, total = [], 0   # entries already widened (as many as the run holds exactly), else one per token
        while total < run and k + len(taken) < len(lengths):
            taken.append(lengths[k + len(taken)])
            total += taken[-1]
        if total == run:
            return taken
        if run > len(lengths) - k:
            raise RequestRejectedError(
                f"the prompt has a run of {run} {what} tokens (id {token}) for {len(lengths) - k} {what}(s) left: "
                f"give one per {what} (widened here) or exactly the {'/'.join(map(str, lengths[k:]))} positions "
                f"of its {what}s", param="multi_modal_data")
        return list(lengths[k:k + run])

    def prepare(self, data: Any, settings: dict[str, Any] | None = None) -> PreparedImages:
        """A request's ``multi_modal_data`` decoded, through the image processor and digested (what the async front
        does in a worker thread, so that the engine's loop never runs the processor). ``settings``: the request's
        own ``mm_processor_kwargs`` (as the engine's option takes them), for its images alone.

        Raises:
            RequestRejectedError: see :meth:`images_of` and :meth:`pixel_values`; settings the processor cannot
                take.
        """
        processor = None
        if settings:
            import copy

            from plinth.config import ConfigError

            if not isinstance(settings, dict):
                raise RequestRejectedError("mm_processor_kwargs must be a dict of the image processor's settings",
                                           param="mm_processor_kwargs")
            processor = copy.deepcopy(self.processor)
            try:
                _apply_settings(processor, settings, self.qwen, tile_settings(self.mm_config))
            except ConfigError as exc:
                raise RequestRejectedError(str(exc), param="mm_processor_kwargs") from None
            self._check_bounds(settings)
        images = self.images_of(data)
        videos = self._videos_of(data)
        if not images and not videos:
            return PreparedImages((), (), (), ())
        prepared = self._with_videos(self._prepare_images(images, processor), videos, settings)
        # the pixels in the model's dtype here, off the engine's loop: every encoder casts them to it first, so they
        # take half the memory while queued and half the bytes to the device (bfloat16 and float16 models)
        if any(p.dtype != self.dtype and p.is_floating_point() for p in prepared.pixels):
            prepared = dataclasses.replace(prepared, pixels=tuple(p.to(self.dtype) if p.is_floating_point() else p
                                                                  for p in prepared.pixels))
        return prepared

    def _check_bounds(self, settings: dict[str, Any]) -> None:
        """Refuse a request's ``max_pixels`` / ``video_max_pixels`` above the engine's: start-up sized the encoder's
        largest pass (and so the memory it left the KV cache) by those.

        Raises:
            RequestRejectedError: as above.
        """
        engine = self.processor_kwargs or {}
        for key in ("max_pixels", "video_max_pixels"):
            if key not in settings:
                continue
            if key == "max_pixels":
                size = getattr(self.processor, "size", None)
                bound = engine.get(key, size.get("longest_edge") if hasattr(size, "get") else None)
            else:
                bound = self.video.max_pixels if self.video is not None else None
            if bound is not None and settings[key] > bound:
                raise RequestRejectedError(f"mm_processor_kwargs: {key} {settings[key]} is more than the engine's "
                                           f"{bound}, which its memory was sized for (start it with a larger "
                                           "--mm-processor-kwargs bound)", param="mm_processor_kwargs")

    def _videos_of(self, data: Any) -> list[Any]:
        if self.video is None or "video" not in data:
            return []
        from plinth.multimodal.video import videos_in

        return videos_in(data["video"], self.video_limit)

    def _with_videos(self, prepared: PreparedImages, videos: list[Any],
                     settings: dict[str, Any] | None) -> PreparedImages:
        """``prepared`` (the images) with the videos' patches after them, each entry with its placeholder token."""
        if not videos:
            return prepared
        from plinth.multimodal import video as v

        try:   # (a request's settings on top of the engine's)
            cfg = (v.video_settings(self.mm_config, self.path, {**(self.processor_kwargs or {}), **settings})
                   if settings else self.video)
        except ModelLoadError as exc:
            raise RequestRejectedError(f"mm_processor_kwargs: {exc}", param="mm_processor_kwargs") from None
        n, m = len(prepared.pixels), cfg.merge * cfg.merge
        if self.max_positions is not None:   # (before any patches are made: a long video's are large)
            for i, video in enumerate(videos):
                t, h, w = v.grid_of(cfg, video)
                if t * h * w // m > self.max_positions:
                    raise RequestRejectedError(f"video {i} fills {t * h * w // m} positions, more than the "
                                               f"{self.max_positions} a prompt may (max_model_len)",
                                               param="multi_modal_data")
        if cfg.qwen3:
            return self._qwen3_videos(prepared, videos, cfg)
        made = [v.patches(cfg, video) for video in videos]
        scales = [v.time_scale(cfg, video) for video in videos]
        k = len(videos)
        return PreparedImages(
            prepared.pixels + tuple(p for p, _ in made),
            # (the key holds the time scale: the same frames at another rate sit at other rotary positions)
            prepared.keys + tuple("v" + _digest(p, (g, scale)) for (p, g), scale in zip(made, scales, strict=True)),
            prepared.sizes + (None,) * k,
            prepared.lengths + tuple(t * h * w // m for _, (t, h, w) in made),
            tuple(prepared.grids) + tuple(g for _, g in made),
            (tuple(prepared.embeds) or (None,) * n) + (None,) * k,
            (self.token_id,) * n + (self.video_token_id,) * k,
            (None,) * n + tuple(scales))

    def _qwen3_videos(self, prepared: PreparedImages, videos: list[Any], cfg: Any) -> PreparedImages:
        """Qwen3-VL: ``prepared`` with each video's frame groups after it, an entry each (the vision tower and the
        rotary positions take a frame group as an image, its time written before it in the prompt)."""
        from plinth.multimodal import video as v

        pixels, keys, lengths, grids = [], [], [], []
        for video in videos:
            patches, (t, h, w) = v.patches(cfg, video)
            for group in patches.split(h * w):
                group = group.clone()   # (a view would keep the whole video's patches alive in the cache)
                pixels.append(group)
                keys.append("v" + _digest(group, (1, h, w)))
                lengths.append(h * w // (cfg.merge * cfg.merge))
                grids.append((1, h, w))
        n, k = len(prepared.pixels), len(pixels)
        return PreparedImages(
            prepared.pixels + tuple(pixels), prepared.keys + tuple(keys), prepared.sizes + (None,) * k,
            prepared.lengths + tuple(lengths), tuple(prepared.grids) + tuple(grids),
            (tuple(prepared.embeds) or (None,) * n) + (None,) * k, (self.token_id,) * n + (self.video_token_id,) * k,
            stamps=tuple(tuple(v.stamps(cfg, video)) for video in videos))

    def _stamped(self, ids: Sequence[int], stamps: Sequence[Sequence[float]], width: Sequence[int]) -> list[int]:
        """Qwen3-VL: the prompt with each video's token (and the vision start and end tokens around it, which each
        frame group takes instead) made into its frame groups: ``<1.5 seconds>`` as text, then the vision start
        token, the video token (widened later), the vision end token, as Qwen3-VL's processor writes them (the first
        time tokenized with the text before it). A prompt laid out already (a run of each video's group width, its
        ``width``, for every frame group) is kept as it is.

        Raises:
            RequestRejectedError: video tokens that are neither one for each video nor such a layout.
        """
        video = self.video_token_id
        runs = [j - i for i, j in _runs(ids, video)]
        if runs == [w for w, groups in zip(width, stamps, strict=True) for _ in groups]:
            return list(ids)   # (laid out already)
        if sum(runs) != len(stamps):   # (one video token for each video, adjacent ones too)
            raise RequestRejectedError(
                f"the prompt names {sum(runs)} video(s) (video token id {video}) but multi_modal_data has "
                f"{len(stamps)}: put one video token where each video goes (plinth writes its frame groups)",
                param="multi_modal_data")
        start = int(self.mm_config.vision_start_token_id)
        end = int(self.mm_config.vision_end_token_id)
        tok = self.tokenizer
        special = set(getattr(tok, "added_tokens_decoder", {}) or {}) if tok is not None else set()
        out: list[int] = []
        k = i = 0
        while i < len(ids):
            if ids[i] != video:
                out.append(ids[i])
                i += 1
                continue
            wrapped = bool(out) and out[-1] == start and i + 1 < len(ids) and ids[i + 1] == end
            if wrapped:
                out.pop()
            for g, seconds in enumerate(stamps[k]):
                text = f"<{seconds:.1f} seconds>"
                if tok is None:
                    raise RequestRejectedError("this model's videos need its tokenizer (their times are text)",
                                               param="multi_modal_data")
                j = len(out)
                while g == 0 and j > 0 and out[j - 1] not in special:
                    j -= 1   # (the text before the first time: tokenized with it, as the processor's text is)
                before = tok.decode(out[j:], clean_up_tokenization_spaces=False) if j < len(out) else ""
                out[j:] = list(tok.encode(before + text, add_special_tokens=False))
                out.extend((start, video, end))
            k += 1
            i += 2 if wrapped else 1
        return out

    def laid_out(self, ids: Sequence[int], media: Sequence[Any]) -> list[int]:
        """A prompt's tokens with its images and videos (pictures and :class:`~plinth.multimodal.video.Video` s, in
        the prompt's order) laid out as :meth:`items` lays them out, without making their pixels (``/tokenize``).

        Raises:
            RequestRejectedError: see :meth:`expand`.
        """
        from plinth.multimodal import video as v

        images = [m for m in media if not isinstance(m, v.Video)]
        videos = [m for m in media if isinstance(m, v.Video)]
        crops = self.crops_of(images)
        ids = self.prompt_ids(ids, crops)
        # (Gemma 3: an image with pan-and-scan crops is its entry and one more for each crop)
        lengths = [self.length_of(m) for m, k in zip(images, crops, strict=True) for _ in range(1 + k)]
        tokens = [self.token_id] * len(lengths)
        patterns = [self.pattern_of(m) for m, k in zip(images, crops, strict=True) for _ in range(1 + k)]
        if videos and self.video.qwen3:
            grids = [v.grid_of(self.video, m) for m in videos]
            widths = [h * w // (self.video.merge ** 2) for _, h, w in grids]
            ids = self._stamped(ids, [v.stamps(self.video, m) for m in videos], widths)
            for (t, _, _), width in zip(grids, widths, strict=True):
                lengths += [width] * t
                tokens += [self.video_token_id] * t
        else:
            lengths += [self.length_of(m) for m in videos]
            tokens += [self.video_token_id] * len(videos)
        patterns += [None] * (len(tokens) - len(patterns))
        return self.expand(ids, lengths, tokens, patterns)[0]

    def _prepare_images(self, images: list[Any], processor: Any) -> PreparedImages:
        if not images:
            return PreparedImages((), (), (), (), ())
        embedded = [img for img in images if isinstance(img, EmbeddedImage)]
        prepared = self._prepare_pictures([img for img in images if not isinstance(img, EmbeddedImage)], processor)
        if not embedded:
            return prepared
        # images given as embeddings keep their place among the pictures (each picture's entries: Gemma 3's crops)
        out: list[tuple[Any, ...]] = []
        pictures = iter(zip(prepared.pixels, prepared.keys, prepared.sizes, prepared.lengths,
                            prepared.grids or (None,) * len(prepared.pixels), strict=True))
        crops = iter(prepared.crops)
        every: list[int] = []   # each image's crops
        for img in images:
            if isinstance(img, EmbeddedImage):
                out.append((torch.empty(0), "e" + _digest(img.embeds.float(), img.grid), None, len(img.embeds),
                            img.grid, img.embeds))
                every.append(0)
            else:
                every.append(next(crops, 0))
                out.extend((*next(pictures), None) for _ in range(1 + every[-1]))
        pixels, keys, sizes, lengths, grids, embeds = zip(*out, strict=True)
        return PreparedImages(pixels, keys, sizes, lengths, grids if self.qwen else (), embeds,
                              crops=tuple(every) if prepared.crops else ())

    def _prepare_pictures(self, images: list[Any], processor: Any = None) -> PreparedImages:
        from plinth.multimodal.vision import tokens_per_image

        if not images:
            return PreparedImages((), (), (), (), ())
        if self.qwen:
            pixels, grids = self.patches(images, processor)
            return PreparedImages(tuple(pixels), tuple(_digest(p, g) for p, g in zip(pixels, grids, strict=True)),
                                  (None,) * len(images),
                                  tuple(t * h * w // (self.merge * self.merge) for t, h, w in grids), tuple(grids))
        if self.pixtral:
            return self._pixtral_pictures(images, processor)
        if self.patterned:
            return self._tiled_pictures(images, processor)
        if self.layout is not None and getattr(processor or self.processor, "do_pan_and_scan", False):
            return self._gemma3_crops(images, processor)
        pixels = self.pixel_values(images, processor)
        sizes = tuple((img.height, img.width) if self.tiled else None for img in images)
        lengths = tuple(tokens_per_image(self.mm_config, size) for size in sizes)
        return PreparedImages(tuple(pixels), tuple(_digest(p, s) for p, s in zip(pixels, sizes, strict=True)),
                              sizes, lengths)

    def _gemma3_crops(self, images: list[Any], processor: Any = None) -> PreparedImages:
        """Gemma 3 with pan-and-scan: each image whole, then each of its crops (as many as
        :func:`~plinth.multimodal.gemma3.crop_count` says), an entry each, with the processor's pixels."""
        from plinth.multimodal.gemma3 import crop_count

        proc = processor or self.processor
        size = self.image_size
        pixels: list[torch.Tensor] = []
        crops: list[int] = []
        for img in images:
            count = crop_count(img.height, img.width, proc)
            try:
                out = proc(images=[img], return_tensors="pt")
                pv, made = out["pixel_values"], [int(c) for c in out.get("num_crops", [count])]
            except Exception as exc:   # noqa: BLE001 - a processor's failure on one odd image
                raise RequestRejectedError(f"the image processor cannot take this image: {type(exc).__name__}: "
                                           f"{exc}", param="multi_modal_data") from None
            if pv.dim() != 4 or len(pv) != 1 + count or tuple(pv.shape[-2:]) != (size, size) or made != [count]:
                raise RequestRejectedError(f"the image processor made pixels of shape {tuple(pv.shape)} and {made} "
                                           f"crops for a {img.width}x{img.height} image; expected {1 + count} images "
                                           f"of {size}x{size}", param="multi_modal_data")
            pixels.extend(pv[j:j + 1].clone().float() for j in range(len(pv)))
            crops.append(count)
        return PreparedImages(tuple(pixels), tuple(_digest(p, None) for p in pixels), (None,) * len(pixels),
                              (self.tokens_per_image or 0,) * len(pixels), crops=tuple(crops))

    def _pixtral_pictures(self, images: list[Any], processor: Any = None) -> PreparedImages:
        """Mistral 3: each image resized by the processor (its longest side within ``longest_edge``, both sides whole
        merged patches), its ``[C, H, W]`` pixels, and its prompt: rows of image tokens, a break after each, the
        last an end token."""
        from plinth.multimodal.pixtral import layout

        if self.break_ids is None:
            raise RequestRejectedError("this Mistral 3 checkpoint's tokenizer has no [IMG_BREAK] / [IMG_END] tokens, "
                                       "which an image's prompt needs", param="multi_modal_data")
        unit = int(self.mm_config.vision_config.patch_size) * int(self.mm_config.spatial_merge_size)
        pixels, patterns = [], []
        for img in images:
            try:
                out = (processor or self.processor)(images=[img], patch_size={"height": unit, "width": unit},
                                                    return_tensors="pt")
                (h, w), = [tuple(int(v) for v in s) for s in out["image_sizes"]]
                pv = out["pixel_values"][0, :, :h, :w]
            except Exception as exc:   # noqa: BLE001 - a processor's failure on one odd image
                raise RequestRejectedError(f"the image processor cannot take this image: {type(exc).__name__}: "
                                           f"{exc}", param="multi_modal_data") from None
            if h % unit or w % unit:
                raise RequestRejectedError(f"the image processor made a {w}x{h} image, not whole {unit}-pixel "
                                           "squares", param="multi_modal_data")
            pixels.append(pv.clone().float())
            patterns.append(tuple(layout(h // unit, w // unit, self.token_id, *self.break_ids)))
        return PreparedImages(tuple(pixels), tuple(_digest(p, None) for p in pixels), (None,) * len(images),
                              tuple(len(p) for p in patterns), patterns=tuple(patterns))

    def _tiled_pictures(self, images: list[Any], processor: Any = None) -> PreparedImages:
        """Idefics3 / SmolVLM, InternVL: each image's tiles (``[tiles, C, S, S]``: Idefics3's grid and global view,
        InternVL's grid and thumbnail) as the processor cuts them, and its prompt (the model's ``PromptTokens``)."""
        from plinth.multimodal.llama4 import tile_count

        if self.tiles is None:
            raise RequestRejectedError("this checkpoint's tokenizer lacks the tokens an image's prompt needs "
                                       "(<fake_token_around_image>; InternVL: <img>, </img>; Llama 4: <|image_start|>, "
                                       "<|image_end|>, <|image|>, <|tile_x_separator|>, <|tile_y_separator|>)",
                                       param="multi_modal_data")
        size = self.image_size
        pixels, patterns = [], []
        for img in images:
            try:
                if self.internvl:
                    out = (processor or self.processor)(images=[img], return_tensors="pt")
                    pv = out["pixel_values"]
                    grid: tuple[int, ...] = (int(out["num_patches"][0]),)
                    tiles = grid[0]
                elif self.llama4:
                    out = (processor or self.processor)(images=[img], return_tensors="pt")
                    pv, (grid,) = out["pixel_values"], [tuple(int(v) for v in g) for g in out["aspect_ratios"]]
                    tiles = tile_count(*grid)
                else:
                    out = (processor or self.processor)(images=[img], return_tensors="pt", return_row_col_info=True)
                    pv, rows, cols = out["pixel_values"][0], int(out["rows"][0][0]), int(out["cols"][0][0])
                    grid, tiles = (rows, cols), rows * cols + 1 if rows else 1
            except Exception as exc:   # noqa: BLE001 - a processor's failure on one odd image
                raise RequestRejectedError(f"the image processor cannot take this image: {type(exc).__name__}: "
                                           f"{exc}", param="multi_modal_data") from None
            if pv.dim() != 4 or pv.shape[-2:] != (size, size) or len(pv) != tiles:
                raise RequestRejectedError(f"the image processor made tiles of shape {tuple(pv.shape)} for {grid} "
                                           f"tiles; the vision tower takes {size}x{size} ones", param="multi_modal_data")
            pixels.append(pv.clone().float())
            patterns.append(tuple(self.tiles.layout(*grid)))
        return PreparedImages(tuple(pixels), tuple(_digest(p, None) for p in pixels), (None,) * len(images),
                              tuple(len(p) for p in patterns), patterns=tuple(patterns))

    def prompt_ids(self, ids: Sequence[int], crops: Sequence[int] = ()) -> list[int]:
        """A prompt's tokens with each image named by one image token (Gemma 3: its ``<start_of_image>`` made into the
        tokens its processor writes around an image, with ``crops``, each image's pan-and-scan crops, see
        :class:`~plinth.multimodal.gemma3.PromptLayout`; the other models' prompts as they are)."""
        return self.layout.expand_prompt(ids, crops) if self.layout is not None else list(ids)

    def items(self, ids: Sequence[int], data: Any) -> tuple[list[int], list[ImageItem]]:
        """``(expanded prompt, its images)`` of a prompt and its ``multi_modal_data`` (or its
        :class:`PreparedImages`)."""
        prepared = data if isinstance(data, PreparedImages) else self.prepare(data)
        ids = self.prompt_ids(ids, prepared.crops)
        if prepared.stamps:   # (Qwen3-VL's videos: their frame groups, each after its time)
            first = len(prepared.lengths) - sum(len(groups) for groups in prepared.stamps)
            widths, k = [], first
            for groups in prepared.stamps:
                widths.append(prepared.lengths[k])
                k += len(groups)
            ids = self._stamped(ids, prepared.stamps, widths)
        if self.break_ids is not None and any(t in self.break_ids for t in ids):
            raise RequestRejectedError("the prompt has image row-break or end tokens ([IMG_BREAK], [IMG_END]): give "
                                       "one [IMG] where each image goes; plinth lays out its rows",
                                       param="multi_modal_data")
        if self.tiles is not None and self.tiles.laid_out(ids):
            raise RequestRejectedError("the prompt carries an image's layout already (<fake_token_around_image>; "
                                       "InternVL: <img>; Llama 4: <|image_start|>): give one image token where each "
                                       "image goes; plinth lays out its tiles", param="multi_modal_data")
        expanded, spans = self.expand(ids, prepared.lengths, prepared.tokens, prepared.patterns)
        grids = prepared.grids or (None,) * len(spans)
        embeds = prepared.embeds or (None,) * len(spans)
        scales = prepared.time_scales or (None,) * len(spans)
        masks = [None if p is None else np.asarray(p) == self.embedding_token for p in prepared.patterns] \
            if prepared.patterns else [None] * len(spans)
        items = sorted((ImageItem(offset, length, prepared.pixels[i], prepared.keys[i], prepared.sizes[i], grids[i],
                                  embeds=embeds[i], time_scale=scales[i], mask=masks[i])
                        for i, (offset, length) in enumerate(spans)), key=lambda item: item.offset)
        if self.qwen:
            _, positions = self._layout(items)
            items = [dataclasses.replace(item, rope=rows) for item, rows in zip(items, positions, strict=True)]
        return expanded, items

    def rope_layout(self, items: Sequence[ImageItem]) -> Any:
        """A prompt's multimodal RoPE layout (:class:`~plinth.multimodal.mrope.RopeLayout`) given its images, or
        ``None`` (a model without one, or no images)."""
        return self._layout(items)[0] if self.qwen and items else None

    def _layout(self, items: Sequence[ImageItem]) -> Any:
        from plinth.multimodal.mrope import layout

        return layout([(item.offset, item.length, item.grid, item.time_scale) for item in items], self.merge)


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` of each run of ``token`` in ``ids``."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] != token:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == token:
            j += 1
        out.append((i, j))
        i = j
    return out


@dataclasses.dataclass(frozen=True)
class PreparedImages:
    """A request's images as :meth:`ImageSupport.prepare` made them: each one's ``[tiles, C, S, S]`` pixels (Qwen2-VL:
    patches), digest, size (LLaVA-NeXT; else ``None``), the positions it fills, and (Qwen2-VL) its patch grid."""

    pixels: tuple[torch.Tensor, ...]
    keys: tuple[str, ...]
    sizes: tuple[tuple[int, int] | None, ...]
    lengths: tuple[int, ...]
    grids: tuple[tuple[int, int, int], ...] = ()
    embeds: tuple[torch.Tensor | None, ...] = ()   # images given as embeddings (their pixels empty), else ()
    tokens: tuple[int, ...] = ()       # each entry's placeholder token (Qwen2-VL's videos after the images); () images
    time_scales: tuple[tuple[float, float] | None, ...] = ()   # each entry's ImageItem.time_scale; () all None
    patterns: tuple[tuple[int, ...] | None, ...] = ()   # each entry's prompt tokens (Mistral 3); () placeholders
    #: Qwen3-VL: each video's frame groups' times in seconds (its groups are entries of their own); () none
    stamps: tuple[tuple[float, ...], ...] = ()
    #: Gemma 3: each picture's pan-and-scan crops (a picture is then its entry and one more for each crop, in
    #: order); () none
    crops: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddedImage:
    """An image given as its embeddings: ``[positions, hidden]`` on the CPU, and (Qwen2-VL) its patch grid."""

    embeds: torch.Tensor
    grid: tuple[int, int, int] | None = None


class ImageParts:
    """A conversation's images (and Qwen2-VL's videos), collected from its messages' content parts in order; each
    part becomes an :class:`~plinth.core.engine.ImagePart` (:class:`~plinth.core.engine.VideoPart`) holding the
    image (video) token's text."""

    def __init__(self, placeholder: str, policy: MediaPolicy | None = None, loaded: dict[str, Any] | None = None,
                 load: bool = True, limit: int | None = None, video_placeholder: str | None = None,
                 video_limit: int | None = None, video_sampler: Any = None):
        self.placeholder = placeholder
        self.limit = limit   # the most images (refused before the one past it is read)
        self.policy = policy
        self.loaded = loaded or {}   # images (and videos) already loaded (off the server's event loop), by URL
        self.load = load   # False: the parts only (a conversation whose images are not needed)
        self.images: list[Any] = []
        #: the video token's text (a model that takes videos), else ``None``
        self.video_placeholder = video_placeholder
        self.video_limit = video_limit
        self.videos: list[Any] = []
        self.video_sampler = video_sampler   # how a video file's frames are chosen (Qwen3-VL's sampling)

    def multi_modal_data(self) -> dict[str, Any] | None:
        """The collected images and videos as a request's ``multi_modal_data`` (``None``: none)."""
        data = {k: v for k, v in (("image", self.images), ("video", self.videos)) if v}
        return data or None

    def add_video(self, value: Any, where: str) -> str:
        """The part of a ``video_url`` value (``{"url": "data:video/..."}`` or the URL) or of a video's frames
        (Python's ``video`` parts: what ``multi_modal_data["video"]`` takes).

        Raises:
            RequestRejectedError: a model without video inputs, more videos than the limit, not a video.
        """
        from plinth.core.engine import VideoPart

        if self.video_placeholder is None:
            raise RequestRejectedError(f"{where}: this model takes no videos", param="multi_modal_data")
        if isinstance(value, dict) and "url" in value:
            value = value.get("url")
        if not self.load:
            return VideoPart(self.video_placeholder)
        if self.video_limit is not None and len(self.videos) >= self.video_limit:
            raise RequestRejectedError(f"{where}: more than {self.video_limit} videos in a prompt "
                                       "(--limit-mm-per-prompt)", param="multi_modal_data")
        from plinth.multimodal import video as v

        if isinstance(value, str):   # (videos loaded ahead are kept under ("video", url))
            found = self.loaded.get(("video", value)) or v.video_from_url(value, where, self.policy,
                                                                          self.video_sampler)
        else:
            found = v.video_of(value, where)
        self.videos.append(found)
        return VideoPart(self.video_placeholder)

    def add(self, value: Any, where: str) -> str:
        """The part of an ``image_url`` value (``{"url": "data:..."}`` or the URL) or a PIL image (Python's
        ``image_pil`` parts).

        Raises:
            RequestRejectedError: not a data URL of an image, or not an image.
        """
        from plinth.core.engine import ImagePart

        if isinstance(value, dict):
            value = value.get("url")
        if not self.load:
            return ImagePart(self.placeholder)
        if self.limit is not None and len(self.images) >= self.limit:
            raise RequestRejectedError(f"{where}: more than {self.limit} images in a prompt (--limit-mm-per-prompt)",
                                       param="multi_modal_data")
        if isinstance(value, str):
            image = self.loaded.get(value) or image_from_url(value, where, self.policy)
        else:
            image = _as_pil(value, where)
        self.images.append(image)
        return ImagePart(self.placeholder)


def salted_key(key: str, salt: str | None, epoch: int) -> str:
    """An image's cache key for requests of ``cache_salt`` ``salt`` after ``epoch`` prefix-cache resets: another
    tenant's request, or a request after a reset, never finds the image encoded (nor its blocks cached)."""
    h = hashlib.blake2b(key.encode(), digest_size=16)
    h.update(repr((salt, epoch)).encode())
    return h.hexdigest()


def _digest(pixels: torch.Tensor, size: Any) -> str:   # (size: an image's size, a grid, what else tells apart)
    h = hashlib.blake2b(pixels.contiguous().numpy().tobytes(), digest_size=16)
    h.update(repr((tuple(pixels.shape), size)).encode())
    return h.hexdigest()


def _image_processor(mm_config: Any, path: str | None) -> Any:
    """The checkpoint's image processor (its ``preprocessor_config.json``), else the vision tower's usual one
    (CLIP's or SigLIP's) at the tower's image size."""
    import transformers

    if getattr(mm_config, "model_type", None) == "llama4":   # (plinth's: transformers' needs torchvision)
        from plinth.multimodal.llama4 import ImageProcessor

        return ImageProcessor.for_checkpoint(mm_config, path)
    if path is not None and (Path(path) / "preprocessor_config.json").is_file():
        try:
            return transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
        except Exception as exc:   # noqa: BLE001
            raise ModelLoadError(f"{path}/preprocessor_config.json: cannot build the image processor: "
                                 f"{type(exc).__name__}: {exc}") from exc
    from plinth.multimodal.pixtral import is_pixtral
    from plinth.multimodal.qwen_vision import is_qwen_vl

    if is_pixtral(mm_config):
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        unit = int(mm_config.vision_config.patch_size) * int(mm_config.spatial_merge_size)
        return PixtralImageProcessorPil(patch_size={"height": unit, "width": unit},
                                        size={"longest_edge": int(mm_config.vision_config.image_size)})
    if getattr(mm_config, "model_type", None) == "internvl":   # (InternVL's processor: up to 12 tiles, a thumbnail)
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        from plinth.multimodal.internvl import square_size

        side = square_size(mm_config.vision_config.image_size)
        return GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True,
                                        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    if getattr(mm_config, "model_type", None) in ("idefics3", "smolvlm"):   # (tiles of the tower's size, 4 a side)
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        side = int(mm_config.vision_config.image_size)
        return SmolVLMImageProcessorPil(size={"longest_edge": 4 * side}, max_image_size={"longest_edge": side})
    if is_qwen_vl(mm_config):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        v = mm_config.vision_config
        return Qwen2VLImageProcessorPil(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                        merge_size=v.spatial_merge_size)
    size = int(mm_config.vision_config.image_size)
    if getattr(mm_config, "model_type", None) == "llava_next":
        return transformers.LlavaNextImageProcessor(size={"shortest_edge": size},
                                                    crop_size={"height": size, "width": size},
                                                    image_grid_pinpoints=mm_config.image_grid_pinpoints)
    if mm_config.vision_config.model_type == "siglip_vision_model":
        return transformers.SiglipImageProcessor(size={"height": size, "width": size})
    logger.info("no preprocessor_config.json: images are processed as CLIP's processor does at %dx%d", size, size)
    return transformers.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


#: the most tiles InternVL's ``max_patches`` may ask for an image (each fills 256 positions)
MAX_TILES_SETTING = 48
#: ``mm_processor_kwargs`` any image processor takes (they change pixel values, not the tiles the tower expects)
SAFE_SETTINGS = ("do_normalize", "do_rescale", "rescale_factor", "do_convert_rgb")
#: and Qwen2-VL's resize bounds (the patches' count, not their size)
QWEN_SETTINGS = ("min_pixels", "max_pixels")
#: Qwen2-VL's resize bounds of video frames (:mod:`plinth.multimodal.video`; not the image processor's)
VIDEO_SETTINGS = ("video_min_pixels", "video_max_pixels")


def tile_settings(mm_config: Any) -> tuple[str, ...]:
    """The settings that choose how many tiles an image is cut into, which a model's processor takes as
    ``mm_processor_kwargs`` (InternVL's ``min_patches`` / ``max_patches`` / ``crop_to_patches``, Idefics3's
    ``do_image_splitting``, Gemma 3's pan-and-scan): the tiles keep the tower's size."""
    kind = getattr(mm_config, "model_type", None)
    if kind == "internvl":
        return ("min_patches", "max_patches", "crop_to_patches")
    if kind in ("idefics3", "smolvlm"):
        return ("do_image_splitting",)
    if kind == "llama4":
        return ("max_patches", "resize_to_max_canvas")
    if kind == "gemma3":
        from plinth.multimodal.gemma3 import PAN_AND_SCAN_DEFAULTS

        return tuple(PAN_AND_SCAN_DEFAULTS)
    return ()


def _apply_settings(processor: Any, settings: dict[str, Any], qwen: bool, tiles: tuple[str, ...] = ()) -> None:
    """Set ``mm_processor_kwargs`` on the image processor: Qwen2-VL's ``min_pixels`` / ``max_pixels`` (its resize
    bounds), the tile counts ``tiles`` names (:func:`tile_settings`) and :data:`SAFE_SETTINGS`, each given a value of
    its current type. Settings that shape what the vision tower takes (patch and tile sizes) are refused: the
    checkpoint fixes them.

    Raises:
        ConfigError: another setting, a value of another type, or bounds out of order.
    """
    from plinth.config import ConfigError

    allowed = (*QWEN_SETTINGS, *VIDEO_SETTINGS, *SAFE_SETTINGS) if qwen else (*SAFE_SETTINGS, *tiles)
    pixels: dict[str, int] = {}
    for key, value in settings.items():
        if key not in allowed:
            raise ConfigError(f"mm_processor_kwargs: {key!r} cannot be set (the checkpoint fixes what shapes the "
                              f"vision tower's input); settings taken: {', '.join(allowed)}")
        if key in QWEN_SETTINGS or key in VIDEO_SETTINGS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"mm_processor_kwargs: {key} must be a positive integer, got {value!r}")
            if key in QWEN_SETTINGS:
                pixels[key] = value
            continue
        current = getattr(processor, key, None)
        if current is None or type(value) is not type(current):
            raise ConfigError(f"mm_processor_kwargs: {key} takes a {type(current).__name__} here, got {value!r}")
        if key in ("min_patches", "max_patches") and not 1 <= value <= MAX_TILES_SETTING:
            raise ConfigError(f"mm_processor_kwargs: {key} must be from 1 to {MAX_TILES_SETTING}, got {value!r}")
        if key == "pan_and_scan_max_num_crops" and not 1 <= value <= MAX_TILES_SETTING:
            raise ConfigError(f"mm_processor_kwargs: {key} must be from 1 to {MAX_TILES_SETTING}, got {value!r}")
        if key in ("pan_and_scan_min_crop_size", "pan_and_scan_min_ratio_to_activate") and not value > 0:
            raise ConfigError(f"mm_processor_kwargs: {key} must be above 0, got {value!r}")
        setattr(processor, key, value)
    if getattr(processor, "min_patches", 1) > getattr(processor, "max_patches", MAX_TILES_SETTING):
        raise ConfigError(f"mm_processor_kwargs: min_patches {processor.min_patches} is more than max_patches "
                          f"{processor.max_patches}")
    if pixels:
        from transformers.image_utils import SizeDict

        size = processor.size
        low = pixels.get("min_pixels", size.get("shortest_edge") if hasattr(size, "get") else None)
        high = pixels.get("max_pixels", size.get("longest_edge") if hasattr(size, "get") else None)
        if low is None or high is None:
            raise ConfigError("mm_processor_kwargs: the image processor has no pixel bounds of its own; give both "
                              "min_pixels and max_pixels")
        if low > high:
            raise ConfigError(f"mm_processor_kwargs: min_pixels {low} is more than max_pixels {high}")
        processor.size = SizeDict(shortest_edge=low, longest_edge=high)


def max_patches(mm_config: Any, path: str | None, settings: dict[str, Any] | None) -> int | None:
    """Qwen2-VL: the most patches the checkpoint's processor makes of one image (its ``max_pixels``, with
    ``mm_processor_kwargs``), or of one frame group of a video (the video processor's), else ``None``."""
    from plinth.multimodal.pixtral import is_pixtral
    from plinth.multimodal.qwen_vision import is_qwen_vl
    from plinth.multimodal.video import video_settings

    if is_pixtral(mm_config):   # Mistral 3: a square image of the processor's longest side, in whole merged patches
        processor = _image_processor(mm_config, path)
        patch = int(mm_config.vision_config.patch_size)
        unit = patch * int(mm_config.spatial_merge_size)
        try:
            side = -(-int(processor.size["longest_edge"]) // unit) * unit
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
        return (side // patch) ** 2
    if not is_qwen_vl(mm_config):
        return None
    processor = _image_processor(mm_config, path)
    if settings:
        _apply_settings(processor, settings, True)
    video = video_settings(mm_config, path, settings)
    # (Qwen3-VL: the bound is on all the sampled frames together, of which a video has two or more)
    frames = (max(video.max_pixels // 2, int(video.min_pixels * 1.05)) if video.qwen3 else video.max_pixels) \
        // video.patch ** 2
    try:
        return max(int(processor.size["longest_edge"]) // int(processor.patch_size) ** 2, frames)
    except (AttributeError, KeyError, TypeError, ValueError):
        return frames
