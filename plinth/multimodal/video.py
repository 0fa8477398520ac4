"""Video inputs of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a video's frames to the vision tower's patches, as
transformers' ``Qwen2VLVideoProcessor`` (``Qwen3VLVideoProcessor``) makes them.

Qwen3-VL samples the frames first (:func:`sampled`), bounds the pixels of all of them together, and writes each frame
group's time in the prompt (:func:`stamps`); each of its frame groups then takes its positions as an image does.

Every frame is resized to the same multiple of the merged patch (``smart_resize`` within the video processor's
``min_pixels`` / ``max_pixels``; bicubic with antialiasing on the 8-bit frames, as torchvision resizes them on a
CPU), rescaled and normalized; the last frame is repeated to a multiple of
``temporal_patch_size`` frames; then each group of ``temporal_patch_size`` frames is cut into patches laid out as an
image's are (merged 2x2 units in rows), ``[t * h * w, C * T * P * P]`` with the grid ``(t, h, w)``. The video fills
``t * h * w / merge**2`` prompt positions at its ``<|video_pad|>`` token. Its rotary positions are an image's whose
time component counts the frame groups: one a group for Qwen2-VL; for Qwen2.5-VL ``tokens_per_second`` a second of
video (a group lasts ``temporal_patch_size / fps`` seconds; frames given without a frame rate are taken at 24 a
second, as transformers takes them).

The vision tower attends within each frame group only, so a long video is encoded a few groups at a time
(:mod:`plinth.multimodal.runner`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from plinth.core.scheduler import RequestRejectedError
from plinth.errors import ModelLoadError

#: the Qwen2-VL video processor's default bounds on a frame's pixels (after resizing)
DEFAULT_MIN_PIXELS = 128 * 28 * 28
DEFAULT_MAX_PIXELS = 768 * 28 * 28
#: the Qwen3-VL video processor's default bounds on the pixels of all the sampled frames together
QWEN3_MIN_PIXELS = 128 * 32 * 32
QWEN3_MAX_PIXELS = 32 * 32 * 768
#: the frame rate of frames given without one (transformers' assumption)
DEFAULT_FPS = 24.0
#: the frame rates taken (a frame an hour to 10,000 a second: the rotary time positions stay finite)
MIN_FPS, MAX_FPS = 1 / 3600, 10_000.0
#: the most frames a video may have
MAX_FRAMES = 1024
#: the most pixels of all a video's frames together (before resizing): 768 MiB of 8-bit RGB
MAX_VIDEO_PIXELS = 1 << 28
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class VideoSettings:
    """How a checkpoint's videos become patches (its ``video_preprocessor_config.json``, else the Qwen2-VL video
    processor's defaults at the vision tower's patch sizes)."""

    patch: int
    temporal: int
    merge: int
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    mean: tuple[float, ...] = _CLIP_MEAN
    std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    #: Qwen2.5-VL: rotary time positions a second of video; ``None``: one a frame group (Qwen2-VL)
    tokens_per_second: float | None = None
    #: Qwen3-VL: frames sampled at ``sample_fps`` a second (``min_frames`` to ``max_frames`` of them), the pixel
    #: bounds over all the sampled frames together, each frame group's time written in the prompt as text; the frame
    #: groups take their positions as images do (:func:`stamps`)
    qwen3: bool = False
    sample_frames: bool = True
    sample_fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    #: Qwen3-VL: each frame's pixels capped as qwen-vl-utils caps them (``max_video_tokens`` merged patches, or an
    #: even share of ``max_pixels``)
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        return self.patch * self.merge


@dataclasses.dataclass(frozen=True, eq=False)
class Video:
    """A request's video: ``[T, H, W, 3]`` uint8 frames and their frame rate (``None``: not given)."""

    frames: np.ndarray
    fps: float | None = None
    #: a file read for Qwen3-VL: the file's numbers of the frames held (sampled already, as the model's processor
    #: samples them; ``fps`` the file's rate); ``None``: the frames are the video's
    indices: tuple[int, ...] | None = None


def video_settings(mm_config: Any, path: str | None, settings: dict[str, Any] | None = None) -> VideoSettings:
    """The checkpoint's video settings; ``settings``: ``mm_processor_kwargs`` (``video_min_pixels`` /
    ``video_max_pixels`` bound the frames; ``do_normalize``, ``do_rescale`` and ``rescale_factor`` apply to them as
    to images).

    Raises:
        ModelLoadError: a ``video_preprocessor_config.json`` that cannot be read or whose patch sizes are not the
            vision tower's.
    """
    v = mm_config.vision_config
    patch, temporal, merge = int(v.patch_size), int(v.temporal_patch_size), int(v.spatial_merge_size)
    tps = getattr(v, "tokens_per_second", None) if getattr(mm_config, "model_type", "") == "qwen2_5_vl" else None
    fields: dict[str, Any] = dict(patch=patch, temporal=temporal, merge=merge,
                                  tokens_per_second=float(tps) if tps is not None else None)
    if str(getattr(mm_config, "model_type", "")).startswith("qwen3_vl"):   # (Qwen3VLVideoProcessor's defaults)
        fields.update(qwen3=True, min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS, mean=(0.5, 0.5, 0.5),
                      std=(0.5, 0.5, 0.5))
    file, cfg = _processor_dict(path)
    if cfg is not None:
        try:
            if fields.get("qwen3"):
                for key, kind in (("do_sample_frames", bool), ("fps", float), ("min_frames", int),
                                  ("max_frames", int), ("cap_pixels_per_frame", bool), ("max_video_tokens", int)):
                    if cfg.get(key) is not None:
                        fields["sample_fps" if key == "fps" else "sample_frames" if key == "do_sample_frames"
                               else key] = kind(cfg[key])
            size = cfg.get("size") or {}
            low = cfg.get("min_pixels", size.get("shortest_edge"))
            high = cfg.get("max_pixels", size.get("longest_edge"))
            if low is not None:
                fields["min_pixels"] = int(low)
            if high is not None:
                fields["max_pixels"] = int(high)
            for key, name in (("image_mean", "mean"), ("image_std", "std")):
                if cfg.get(key) is not None:
                    fields[name] = tuple(float(x) for x in cfg[key])
            for key in ("rescale_factor",):
                if cfg.get(key) is not None:
                    fields[key] = float(cfg[key])
            for key in ("do_resize", "do_rescale", "do_normalize"):
                if cfg.get(key) is not None:
                    fields[key] = bool(cfg[key])
            theirs = (int(cfg.get("patch_size", patch)), int(cfg.get("temporal_patch_size", temporal)),
                      int(cfg.get("merge_size", merge)))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{file}: cannot read the video processor's settings: {type(exc).__name__}: "
                                 f"{exc}") from exc
        if theirs != (patch, temporal, merge):
            raise ModelLoadError(f"{file}: patch sizes {theirs} (patch, temporal, merge) are not the vision tower's "
                                 f"{(patch, temporal, merge)}")
    for key in ("video_min_pixels", "video_max_pixels"):
        value = (settings or {}).get(key)
        if value is not None:
            fields[key.removeprefix("video_")] = int(value)
    for key in ("do_normalize", "do_rescale", "rescale_factor"):   # (checked as the image processor's settings)
        if (settings or {}).get(key) is not None:
            fields[key] = settings[key]
    out = VideoSettings(**fields)
    if out.min_pixels > out.max_pixels:
        raise ModelLoadError(f"video min_pixels {out.min_pixels} is more than max_pixels {out.max_pixels}")
    if out.qwen3 and not (out.sample_fps > 0 and 1 <= out.min_frames <= out.max_frames and out.max_video_tokens > 0):
        raise ModelLoadError(f"video sampling settings out of range: fps {out.sample_fps}, frames {out.min_frames} to "
                             f"{out.max_frames}, max_video_tokens {out.max_video_tokens}")
    return out


def _processor_dict(path: str | None) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint's video processor settings and their file, where transformers looks for them, in its order:
    ``processor_config.json``'s ``video_processor``, ``video_preprocessor_config.json``, then the image processor's
    ``preprocessor_config.json`` (older Qwen2-VL checkpoints, whose one processor took videos too).

    Raises:
        ModelLoadError: a file that is not a JSON object.
    """
    if path is None:
        return None, None
    for name, key in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None),
                      ("preprocessor_config.json", None)):
        file = Path(path) / name
        if not file.is_file():
            continue
        from plinth.model_registry.loader import _json_object

        data = _json_object(file)
        if key is None:
            return file, data
        if isinstance(data.get(key), dict):
            return file, data[key]
    return None, None


def video_of(value: Any, where: str) -> Video:
    """A request's video: a list of frames (PIL images or ``[H, W, 3]`` uint8 arrays), a ``[T, H, W, 3]`` uint8
    array or tensor, or either with its frame rate, as ``(frames, {"fps": rate})`` or ``{"frames": frames, "fps":
    rate}``.

    Raises:
        RequestRejectedError: another shape or type, no frames, frames of different sizes, too many frames or pixels,
            a frame rate that is not a positive number.
    """

    if isinstance(value, Video):   # (read already: a video file's frames)
        return value
    fps: Any = None
    if isinstance(value, dict):
        unknown = sorted(str(k) for k in value if k not in ("frames", "fps"))
        if unknown or "frames" not in value:
            raise RequestRejectedError(f"{where}: a video given as a dict has 'frames' (and optionally 'fps'); got "
                                       f"keys {sorted(map(str, value))}", param="multi_modal_data")
        value, fps = value["frames"], value.get("fps")
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, meta = value
        fps = meta.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps)
                            or not MIN_FPS <= fps <= MAX_FPS):
        raise RequestRejectedError(f"{where}: fps must be a positive number from {MIN_FPS} to {MAX_FPS}, got "
                                   f"{fps!r}", param="multi_modal_data")
    return Video(_frames(value, where), float(fps) if fps is not None else None)


def _frames(value: Any, where: str) -> np.ndarray:
    from PIL import Image

    bad = RequestRejectedError(f"{where}: a video is a list of frames (PIL images or [H, W, 3] uint8 arrays) or a "
                               f"[frames, H, W, 3] uint8 array, got {type(value).__name__}", param="multi_modal_data")
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8 or value.is_meta or value.layout != torch.strided:
            raise bad
        _check_extent(tuple(value.shape), where)
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 4 or value.shape[-1] != 3 or 0 in value.shape:
            raise RequestRejectedError(f"{where}: a video array must be [frames, H, W, 3] uint8, got "
                                       f"{list(value.shape)} {value.dtype}", param="multi_modal_data")
        _check_extent(value.shape, where)
        return np.ascontiguousarray(value)
    if not isinstance(value, list | tuple) or not value:
        raise bad
    if len(value) > MAX_FRAMES:
        raise RequestRejectedError(f"{where}: {len(value)} frames, at most {MAX_FRAMES}", param="multi_modal_data")
    out = []
    for i, frame in enumerate(value):
        if isinstance(frame, Image.Image):
            from plinth.multimodal.images import check_size

            check_size(frame.width, frame.height, f"{where} frame {i}")
            frame = np.asarray(frame.convert("RGB"))
        elif not (isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3
                  and frame.shape[-1] == 3):
            raise bad
        if out and frame.shape != out[0].shape:
            raise RequestRejectedError(f"{where}: frame {i} is {frame.shape[1]}x{frame.shape[0]}, frame 0 "
                                       f"{out[0].shape[1]}x{out[0].shape[0]}: a video's frames have one size",
                                       param="multi_modal_data")
        if 0 in frame.shape:
            raise RequestRejectedError(f"{where}: frame {i} is empty", param="multi_modal_data")
        out.append(frame)
    _check_extent((len(out), *out[0].shape), where)
    return np.stack(out)


def _check_extent(shape: tuple[int, ...], where: str) -> None:
    """Refuse ``[frames, H, W, ...]`` of too many frames, a frame too large, or too many pixels in all (before any
    copy is made)."""
    from plinth.multimodal.images import check_size

    if len(shape) < 3:
        return
    t, h, w = shape[:3]
    if t > MAX_FRAMES:
        raise RequestRejectedError(f"{where}: {t} frames, at most {MAX_FRAMES}", param="multi_modal_data")
    check_size(w, h, f"{where} frame")
    if t * h * w > MAX_VIDEO_PIXELS:
        raise RequestRejectedError(f"{where}: {t} frames of {w}x{h} pixels, more than {MAX_VIDEO_PIXELS} pixels in "
                                   "all", param="multi_modal_data")


def resized(settings: VideoSettings, height: int, width: int, frames: int = 1) -> tuple[int, int]:
    """The frames' size after resizing (Qwen3-VL: ``frames`` sampled frames share the pixel bounds).

    Raises:
        RequestRejectedError: a size the resize cannot take (too elongated); frames that are not whole merged
            patches when the settings do not resize.
    """
    f = settings.factor
    if not settings.do_resize:
        if height % f or width % f:
            raise RequestRejectedError(f"the video processor does not resize, and {width}x{height} frames are not "
                                       f"made of whole {f}-pixel squares", param="multi_modal_data")
        return height, width
    try:
        if settings.qwen3:
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as smart_resize_3

            high = settings.max_pixels
            if settings.cap_pixels_per_frame:
                per_frame = max(min(settings.max_video_tokens * f * f, settings.max_pixels // frames),
                                int(settings.min_pixels * 1.05))
                high = per_frame * frames
            return smart_resize_3(frames, height, width, temporal_factor=settings.temporal, factor=f,
                                  min_pixels=settings.min_pixels, max_pixels=high)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=f, min_pixels=settings.min_pixels, max_pixels=settings.max_pixels)
    except ValueError as exc:
        raise RequestRejectedError(f"the video processor cannot take this video: {exc}",
                                   param="multi_modal_data") from None


def sampled(settings: VideoSettings, video: Video) -> np.ndarray:
    """The indices of the frames that become patches: all of them (Qwen2-VL), or Qwen3-VL's sample: ``sample_fps``
    a second of the video's rate (24 where it has none), at least ``min_frames`` and at most ``max_frames`` (and the
    frames there are), spread evenly over the video."""
    total = int(video.frames.shape[0])
    if not settings.qwen3 or not settings.sample_frames or video.indices is not None:
        return np.arange(total)
    count = int(total / (video.fps or DEFAULT_FPS) * settings.sample_fps)
    count = min(max(count, settings.min_frames), settings.max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def stamps(settings: VideoSettings, video: Video) -> list[float]:
    """Qwen3-VL: each frame group's time in seconds (the mean of its first and last frames' times, the last frame
    repeated to fill the last group), as the prompt writes them (``<1.5 seconds>``)."""
    indices = list(video.indices) if video.indices is not None else sampled(settings, video).tolist()
    indices += [indices[-1]] * (-len(indices) % settings.temporal)
    fps = video.fps or DEFAULT_FPS
    times = [i / fps for i in indices]
    tp = settings.temporal
    return [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]


def grid_of(settings: VideoSettings, video: Video) -> tuple[int, int, int]:
    """The video's ``(t, h, w)`` grid of patches."""
    t = len(sampled(settings, video))
    height, width = video.frames.shape[1:3]
    h, w = resized(settings, height, width, t)
    return -(-t // settings.temporal), h // settings.patch, w // settings.patch


def length_of(settings: VideoSettings, video: Video) -> int:
    """The prompt positions the video fills."""
    t, h, w = grid_of(settings, video)
    return t * h * w // (settings.merge * settings.merge)


def time_scale(settings: VideoSettings, video: Video) -> tuple[float, float] | None:
    """Qwen2.5-VL: ``(seconds a frame group lasts, rotary time positions a second)`` (the seconds rounded to float32,
    as the processor gives them); Qwen2-VL: ``None`` (one position a group). See
    :func:`plinth.multimodal.mrope.image_positions`."""
    if settings.tokens_per_second is None:
        return None
    return float(np.float32(settings.temporal / (video.fps or DEFAULT_FPS))), float(settings.tokens_per_second)


def patches(settings: VideoSettings, video: Video) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The video's ``[t * h * w, C * T * P * P]`` float32 patches and its grid."""
    chosen = sampled(settings, video)
    picked = video.frames if len(chosen) == video.frames.shape[0] else video.frames[chosen]
    frames = torch.from_numpy(picked).permute(0, 3, 1, 2).contiguous()   # [T, C, H, W] uint8
    height, width = frames.shape[-2:]
    h, w = resized(settings, height, width, frames.shape[0])
    if (h, w) != (height, width):   # (torch's own 8-bit kernel, as torchvision resizes 8-bit frames on a CPU)
        frames = F.interpolate(frames, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    frames = frames.float()
    if settings.do_normalize:   # (with the rescale folded into the mean and deviation, as transformers does)
        scale = 1.0 / settings.rescale_factor if settings.do_rescale else 1.0
        mean = (torch.tensor(settings.mean) * scale).view(1, -1, 1, 1)
        std = (torch.tensor(settings.std) * scale).view(1, -1, 1, 1)
        frames = (frames - mean) / std
    elif settings.do_rescale:
        frames = frames * settings.rescale_factor
    tp, p, m = settings.temporal, settings.patch, settings.merge
    if pad := -frames.shape[0] % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, c = frames.shape[0] // tp, frames.shape[1]
    gh, gw = h // p, w // p
    x = frames.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)          # [t, gh/m, gw/m, m, m, C, T, P, P]
    return x.reshape(t * gh * gw, c * tp * p * p).contiguous(), (t, gh, gw)


#: the frames a second read from a video file (Qwen2-VL's usual sampling rate)
SAMPLE_FPS = 2.0
#: the most frames decoded from a video file (however few are kept), and the most pixels of them together: bounds on
#: the work a file can ask for
MAX_DECODED_FRAMES = 20_000
MAX_DECODED_PIXELS = 1 << 34


def file_sampler(settings: VideoSettings | None) -> Any:
    """How a video file's frames are chosen for ``settings``: Qwen3-VL's ``(frame count, rate) -> indices`` (its
    processor's sampling over every frame of the file, as transformers reads files); ``None``: :data:`SAMPLE_FPS` a
    second (Qwen2-VL)."""
    if settings is None or not settings.qwen3:
        return None
    if not settings.sample_frames:   # (every frame, as transformers reads a file it does not sample; a range: a
        return lambda total, fps: range(total)   # header's count of billions is refused, not allocated)
    return lambda total, fps: sampled(settings, Video(np.empty((total, 0, 0, 3), np.uint8), fps))


def decode_video(data: bytes, where: str = "video", sample: Any = None) -> Video:
    """A video file's frames (MP4, WebM, AVI, ... whatever FFmpeg reads, through PyAV), :data:`SAMPLE_FPS` a second
    (the first frame, then the first at or after each next sample time; all of them where the file has fewer a
    second), at most :data:`MAX_FRAMES`; its frame rate is that of the frames kept. ``sample`` (:func:`file_sampler`):
    the frames it picks of the file's count and rate where the file states them (the video keeps their numbers).

    Raises:
        RequestRejectedError: PyAV is not installed, the bytes are not a video FFmpeg reads, no frames, frames too
            large, or more frames than :data:`MAX_DECODED_FRAMES`.
    """
    try:
        import av
    except ImportError:
        raise RequestRejectedError(f"{where}: reading video files needs PyAV: pip install 'plinth-llm[video]' (or "
                                   "give the frames themselves in multi_modal_data)") from None
    import io

    from plinth.multimodal.images import check_size

    frames: list[np.ndarray] = []
    times: list[float] = []
    try:
        if sample is not None:   # (Qwen3-VL: the frames its processor picks of the file's stated count and rate)
            picked = _sampled_file(data, sample, where)
            if picked is not None:
                return picked
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise RequestRejectedError(f"{where}: the file has no video stream")
            stream = container.streams.video[0]
            check_size(stream.codec_context.width, stream.codec_context.height, f"{where} frame")
            # frames without times (a raw stream) are spaced by the codec's rate, else the guessed one
            given = stream.codec_context.framerate or stream.guessed_rate or stream.average_rate
            rate = float(given) if given else SAMPLE_FPS
            step, decoded, decoded_pixels, kept_pixels = 1 / SAMPLE_FPS, 0, 0, 0
            next_time: float | None = None   # the next sample time
            for frame in container.decode(stream):
                decoded += 1
                decoded_pixels += frame.width * frame.height
                if decoded > MAX_DECODED_FRAMES or decoded_pixels > MAX_DECODED_PIXELS:
                    raise RequestRejectedError(f"{where}: more than {MAX_DECODED_FRAMES} frames or "
                                               f"{MAX_DECODED_PIXELS} pixels to decode")
                t = float(frame.time) if frame.time is not None else (decoded - 1) / rate
                if next_time is not None and t < next_time:
                    continue
                check_size(frame.width, frame.height, f"{where} frame")
                if frames and (frame.height, frame.width) != frames[0].shape[:2]:
                    raise RequestRejectedError(f"{where}: its frames change size ({frames[0].shape[1]}x"
                                               f"{frames[0].shape[0]}, then {frame.width}x{frame.height}); a "
                                               "video's frames have one size")
                kept_pixels += frame.width * frame.height
                if kept_pixels > MAX_VIDEO_PIXELS:
                    raise RequestRejectedError(f"{where}: more than {MAX_VIDEO_PIXELS} pixels in the frames kept at "
                                               f"{SAMPLE_FPS:g} a second")
                frames.append(frame.to_ndarray(format="rgb24"))
                times.append(t)
                next_time = (t if next_time is None else next_time) + step
                while next_time <= t:   # (past a gap in the file's timestamps)
                    next_time += step
                if len(frames) > MAX_FRAMES:
                    raise RequestRejectedError(f"{where}: more than {MAX_FRAMES} frames at {SAMPLE_FPS:g} a second")
    except RequestRejectedError:
        raise
    except Exception as exc:   # noqa: BLE001 - FFmpeg raises many kinds for a bad file
        raise RequestRejectedError(f"{where} cannot be read as a video: {type(exc).__name__}: {exc}") from None
    if not frames:
        raise RequestRejectedError(f"{where}: the video has no frames")
    span = times[-1] - times[0]
    fps = (len(frames) - 1) / span if len(frames) > 1 and span > 0 else SAMPLE_FPS
    return Video(video_of(np.stack(frames), where).frames, fps)   # (the shape checks of frames given directly)


def _sampled_file(data: bytes, sample: Any, where: str) -> Video | None:
    """A video file's frames that ``sample`` picks of its stated frame count and rate (picked again among the frames
    it has where it states more); ``None``: the file states no count or rate, or has fewer than two frames."""
    import io

    import av

    from plinth.multimodal.images import check_size

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise RequestRejectedError(f"{where}: the file has no video stream")
        stream = container.streams.video[0]
        check_size(stream.codec_context.width, stream.codec_context.height, f"{where} frame")
        total, rate = int(stream.frames or 0), float(stream.average_rate or 0)
        if total <= 0 or not MIN_FPS <= rate <= MAX_FPS:
            return None
        video, decoded = _decode_picked(container, stream, _picked(sample(total, rate), where), rate, where)
    if video is None and decoded >= 2:   # (fewer frames than it states)
        with av.open(io.BytesIO(data), mode="r") as container:
            video, _ = _decode_picked(container, container.streams.video[0], _picked(sample(decoded, rate), where),
                                      rate, where)
    return video


def _picked(indices: Any, where: str) -> list[int]:
    """A sampler's frame numbers as a list, refused before it is made where they are more than :data:`MAX_FRAMES`."""
    if len(indices) > MAX_FRAMES:
        raise RequestRejectedError(f"{where}: {len(indices)} frames, at most {MAX_FRAMES}", param="multi_modal_data")
    return [int(i) for i in indices]


def _decode_picked(container: Any, stream: Any, picked: list[int], fps: float, where: str) -> tuple[Video | None, int]:
    """The frames of numbers ``picked`` (increasing) of a file's video stream, decoded in order up to the last, and
    the frames decoded; ``None`` where the stream ends before the last (it has fewer frames than it states).

    Raises:
        RequestRejectedError: frames too large or changing size, too many to decode or keep.
    """
    from plinth.multimodal.images import check_size

    if len(picked) > MAX_FRAMES:
        raise RequestRejectedError(f"{where}: {len(picked)} frames, at most {MAX_FRAMES}", param="multi_modal_data")
    wanted = set(picked)
    frames: list[np.ndarray] = []
    found: list[int] = []
    decoded = decoded_pixels = kept_pixels = 0
    for i, frame in enumerate(container.decode(stream)):
        if i > picked[-1]:
            break
        decoded += 1
        decoded_pixels += frame.width * frame.height
        if decoded > MAX_DECODED_FRAMES or decoded_pixels > MAX_DECODED_PIXELS:
            raise RequestRejectedError(f"{where}: more than {MAX_DECODED_FRAMES} frames or {MAX_DECODED_PIXELS} "
                                       "pixels to decode")
        if i not in wanted:
            continue
        check_size(frame.width, frame.height, f"{where} frame")
        if frames and (frame.height, frame.width) != frames[0].shape[:2]:
            raise RequestRejectedError(f"{where}: its frames change size ({frames[0].shape[1]}x{frames[0].shape[0]}, "
                                       f"then {frame.width}x{frame.height}); a video's frames have one size")
        kept_pixels += frame.width * frame.height
        if kept_pixels > MAX_VIDEO_PIXELS:   # (before the frames are copied together)
            raise RequestRejectedError(f"{where}: more than {MAX_VIDEO_PIXELS} pixels in the frames kept")
        frames.append(frame.to_ndarray(format="rgb24"))
        found.append(i)
    if not found or found[-1] != picked[-1]:
        return None, decoded
    return Video(video_of(np.stack(frames), where).frames, fps, tuple(found)), decoded


def video_from_url(url: str, where: str = "video_url", policy: Any = None, sample: Any = None) -> Video:
    """A video from a ``data:video/...;base64,...`` URL, or, where ``policy`` allows, a ``file://`` URL under its
    directory or an ``http(s)://`` URL of its domains (:func:`decode_video`).

    Raises:
        RequestRejectedError: a URL the policy does not allow, bad base64, a failed fetch, or not a video.
    """
    from plinth.multimodal.images import media_bytes

    return decode_video(media_bytes(url, where, policy, "video"), where, sample)


def split_groups(grid: tuple[int, int, int], most: int) -> list[int]:
    """A video's frame groups in runs of at most ``most`` patches (at least one group a run): the counts of groups,
    in order (the vision tower attends within a group, so the runs encode apart)."""
    t, h, w = grid
    per = max(1, most // (h * w))
    return [min(per, t - i) for i in range(0, t, per)]


def videos_in(data: Any, limit: int, where: str = "multi_modal_data video") -> list[Video]:
    """The videos of a request's ``multi_modal_data["video"]`` (one video, or a list of them).

    Raises:
        RequestRejectedError: more than ``limit`` videos, or one :func:`video_of` refuses.
    """
    if isinstance(data, list) and data and all(_is_video(v) for v in data):
        values: Sequence[Any] = data
    else:
        values = [data]
    if len(values) > limit:
        raise RequestRejectedError(f"multi_modal_data: {len(values)} videos, at most {limit} a prompt "
                                   "(--limit-mm-per-prompt)", param="multi_modal_data")
    return [video_of(v, f"{where} {i}") for i, v in enumerate(values)]


def _is_video(value: Any) -> bool:
    """Whether one entry of a list is a whole video (a list of frames, a 4-d array, a dict, a (frames, meta) tuple),
    so that the list is a list of videos rather than one video's frames."""
    if isinstance(value, np.ndarray | torch.Tensor):
        return value.ndim == 4
    return isinstance(value, list | dict | Video) or (isinstance(value, tuple) and len(value) == 2
                                              and isinstance(value[1], dict))
