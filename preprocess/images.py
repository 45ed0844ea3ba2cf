"""Image reference -> RGB pixels -> uint8 patches in Hugging Face's Qwen-VL patch order.

The stored form of an image is `pixel_patches`: the resized RGB image as uint8, one
temporal frame, rows in HF's merge-block order and columns (c, py, px). HF resizes in
uint8 before it rescales and normalises, so these bytes lose nothing:
`shards_schema.pixels.pixel_values_from_patches` rebuilds HF's float32 `pixel_values`
from them bit for bit, from an eighth of the bytes (uint8 vs float32, one frame vs T=2).

Two stages, so that a row is judged before any pixel is decoded: `open_image` reads the
header only (format, size, mode, frame count) and `header_grid` gives the image's patch
grid, hence its token count, from the header size; `decode_opened` decodes the pixels
later, only for rows that passed the length check.

Colour rule (the one rule, applied by `decode_opened`):

1. Decode the image (animated GIF/PNG/WebP are rejected: which frame would be meant? A
   multi-page TIFF or a phone's multi-picture JPEG gives its first image), then apply the
   EXIF orientation (`ImageOps.exif_transpose`).
2. 16/32-bit integer and float greyscale (modes I;16*, I, F) are scaled to 8 bits
   explicitly, because PIL's own `convert` clips them (a 16-bit photo becomes mostly
   white): I;16* -> round(v / 257); I -> clip to [0, 65535], then the same; F -> treated
   as intensity in [0, 1]: clip, * 255, round half to even (NaN -> 0). A 16-bit grey
   pixel equal to the image's `transparency` value becomes white (rule 3).
3. An image with alpha (a band "A", e.g. RGBA/LA/PA, or a `transparency` entry in
   `image.info`, e.g. P or L or RGB with a tRNS chunk) is composited onto opaque white.
   This is what `Qwen2VLImageProcessorPil` does to a PIL image with alpha, and what
   qwen-vl-utils does; HF's *string* inputs (`load_image`) drop alpha instead, leaving
   whatever colour hides under transparent pixels, which is usually black.
4. Everything else (L, 1, P, CMYK, YCbCr, ...) -> `convert("RGB")`, as HF does.

An RGB image that needs none of this is used as is (no copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from shards_schema.builtin import VisionConfig
from shards_schema.storage import FetchPolicy

from .errors import RejectError
from .media import (DEFAULT_MAX_MEDIA_BYTES, check_bounds, check_unsupported_size_options, declared_type, part_number,
                    read_media_file, resolve_media)
from .patchify import planes_to_rows

# PIL's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS). PIL's check is off while an
# image is opened and loaded (`_own_pixel_limit`): --max-image-pixels replaces it, above it too.
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970
# A decoded raster may take at most this many bytes per allowed pixel (--max-image-pixels): an
# 8-bit RGB image at the pixel limit; wider pixels (alpha, CMYK, 32-bit) allow fewer of them.
DECODE_BYTES_PER_PIXEL = 3
MAX_ASPECT_RATIO = 200

# RejectError codes raised by this module (the pipeline prefixes "image k: " to the message).
REJECT_CODES = (
    "empty_source",  # image reference not a non-empty string
    "remote_url",  # http(s)/s3/... URL: batch jobs do not fetch
    "bad_data_uri",  # data URI not 'data:<type>;base64,<data>'
    "bad_base64",  # base64 that does not decode
    "no_media_root",  # a file path without --media-root
    "path_outside_media_root",  # a path that resolves outside --media-root
    "bad_path",  # a path that cannot be resolved (NUL byte, symlink loop, bad encoding)
    "missing_file",  # no such file
    "not_a_regular_file",  # a directory, FIFO, socket or device: never read
    "unreadable_file",  # permission denied, I/O error
    "media_too_large",  # file or decoded data URI over --max-media-bytes
    "not_an_image",  # bytes PIL does not recognise
    "mime_mismatch",  # a data URI's type contradicts its bytes
    "animated_image",  # animated GIF/PNG/WebP
    "image_too_large",  # over --max-image-pixels, or its decoded raster over the decode cap
    "bad_image",  # truncated or corrupt
    "unsupported_mode",  # a PIL mode with no RGB conversion
    "aspect_ratio",  # longer side over MAX_ASPECT_RATIO times the shorter
)

_HIGH_BIT_DEPTH_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I", "F"}
# What PIL raises on a broken file: it has no common exception base for decoder failures.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)
_WIDE_BANDS = {"I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2, "I": 4, "F": 4}  # bytes per band; others 1
_ANIMATED_FORMATS = {"GIF", "PNG", "WEBP"}
# image/* subtype of each PIL format a data URI is checked against (MPO: a JPEG with extra
# pictures, as phones write them), and the other names in use for those subtypes.
_FORMAT_SUBTYPE = {"JPEG": "jpeg", "MPO": "jpeg", "PNG": "png", "GIF": "gif", "WEBP": "webp", "BMP": "bmp", "TIFF": "tiff"}
_SUBTYPE_ALIASES = {
    "jpg": "jpeg", "pjpeg": "jpeg", "x-png": "png", "apng": "png", "x-ms-bmp": "bmp", "x-bmp": "bmp", "tif": "tiff"
}
# Subtypes that name a format: declaring one of them for other bytes is a contradiction. Other
# subtypes ("image/undefined", "image/x", as tools write when they do not know) say nothing.
_NAMED_SUBTYPES = set(_FORMAT_SUBTYPE.values()) | {"avif", "heic", "heif", "jxl", "jp2", "svg+xml", "x-icon", "vnd.microsoft.icon"}


# ---------------------------------------------------------------------------------------
# an image part's own size bounds


@dataclass(frozen=True)
class ImageRequest:
    """An image part's own `min_pixels` / `max_pixels` (None: the profile's, --min-pixels /
    --max-pixels): the bounds HF's image processor takes per call, and qwen-vl-utils per image."""

    min_pixels: int | None = None
    max_pixels: int | None = None

    def vision(self, vision: VisionConfig) -> VisionConfig:
        """`vision` with this part's bounds; a minimum over the maximum in force is refused."""
        if self.min_pixels is None and self.max_pixels is None:
            return vision
        bounded = dataclasses.replace(
            vision, min_pixels=vision.min_pixels if self.min_pixels is None else self.min_pixels,
            max_pixels=vision.max_pixels if self.max_pixels is None else self.max_pixels)
        if self.min_pixels is not None:
            check_bounds("min_pixels", bounded.min_pixels, "max_pixels", bounded.max_pixels, "bad_image_option",
                         "the image part's bounds (its own, else --max-pixels, else the profile's)")
        return bounded


def image_request_from_part(part: dict, where: str) -> ImageRequest:
    """An image part's options, checked like a video part's: whole numbers from 1 to 2**53, a
    minimum not over the maximum, no option vlmpack would ignore."""
    check_unsupported_size_options(part, "unsupported_field", where)
    bounds = {name: part_number(part, name, integer=True, code="bad_image_option", where=where)
              for name in ("min_pixels", "max_pixels")}
    check_bounds("min_pixels", bounds["min_pixels"], "max_pixels", bounds["max_pixels"], "bad_image_option", where)
    return ImageRequest(**bounds)


# ---------------------------------------------------------------------------------------
# source string -> bytes


def resolve_image_source(
    source: str, media_root: Path | None, max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    remote: FetchPolicy | None = None,
) -> bytes:
    """The encoded image bytes an image reference points at (`preprocess.media.resolve_media`;
    `remote`: how URLs are fetched, None rejects them)."""
    resolved = resolve_media(source, media_root, max_media_bytes, kind="image", remote=remote)
    return resolved if isinstance(resolved, bytes) else read_media_file(resolved, max_media_bytes, "image")


# ---------------------------------------------------------------------------------------
# bytes -> RGB image


def open_image(
    data: bytes, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, declared: str | None = None
) -> Image.Image:
    """Encoded bytes -> a PIL image whose header (format, size, mode, frames) is read and
    checked, and whose pixels are not decoded yet (`decode_opened` does that).

    Checked: PIL recognises the format; `declared`, a data URI's media type, does not name
    another format (image/jpg for JPEG, image/* and unnamed subtypes are fine); one frame; at most `max_image_pixels` pixels (decompression
    bombs); a decoded raster of at most DECODE_BYTES_PER_PIXEL * `max_image_pixels` bytes.
    """
    try:
        with _own_pixel_limit():
            image = Image.open(io.BytesIO(data))
            frames = getattr(image, "n_frames", 1) if image.format in _ANIMATED_FORMATS else 1
    except UnidentifiedImageError:
        what = "the image is empty (0 bytes)" if not data else f"bytes are not an image PIL can read (starts with {data[:8]!r})"
        raise RejectError("not_an_image", what) from None
    except _DECODE_ERRORS as exc:
        raise RejectError("bad_image", f"image header cannot be parsed ({exc})") from None
    _check_declared_type(declared, image.format)
    if frames > 1:
        raise RejectError(
            "animated_image",
            f"animated {image.format} with {frames} frames; use one frame (save it as a still image), "
            "or pass it as a video",
        )
    width, height = image.size
    decode_bytes = width * height * len(image.getbands()) * _WIDE_BANDS.get(image.mode, 1)
    decode_cap = DECODE_BYTES_PER_PIXEL * max_image_pixels
    if width * height > max_image_pixels or decode_bytes > decode_cap:
        raise RejectError(
            "image_too_large",
            f"{width}x{height} {image.mode} = {width * height} pixels, {decode_bytes} bytes decoded; the limits are "
            f"--max-image-pixels {max_image_pixels} and {decode_cap} bytes decoded "
            f"({DECODE_BYTES_PER_PIXEL} per allowed pixel); shrink the image or raise --max-image-pixels",
        )
    return image


@contextlib.contextmanager
def _own_pixel_limit():
    """PIL's decompression-bomb check (a warning above Image.MAX_IMAGE_PIXELS, an error above
    twice that) turned off: `open_image` checks the header against --max-image-pixels itself,
    and a limit raised above PIL's must let such an image through."""
    previous = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def _check_declared_type(declared: str | None, image_format: str | None) -> None:
    if declared is None or declared in ("", "application/octet-stream", "image/*", "image"):
        return
    major, _, subtype = declared.partition("/")
    subtype = _SUBTYPE_ALIASES.get(subtype, subtype)
    actual = _FORMAT_SUBTYPE.get(image_format or "")
    if major == "image" and (actual is None or subtype == actual or subtype not in _NAMED_SUBTYPES):
        return
    raise RejectError(
        "mime_mismatch",
        f"the data URI says {declared} but its bytes are {image_format} "
        f"({Image.MIME.get(image_format or '', 'no known type')}); fix the data URI's type",
    )


def decode_image(
    data: bytes, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, declared: str | None = None
) -> Image.Image:
    """Encoded bytes -> an RGB PIL image, by the module's colour rule (`open_image` + `decode_opened`)."""
    return decode_opened(open_image(data, max_image_pixels=max_image_pixels, declared=declared))


def decode_opened(image: Image.Image) -> Image.Image:
    """An image from `open_image` -> RGB, by the module's colour rule.

    The file is decoded fully here so a truncated or corrupt file is rejected now, with PIL's
    reason, instead of being padded with grey (`ImageFile.LOAD_TRUNCATED_IMAGES` is forced
    off while loading).
    """
    _load_strict(image)
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except _DECODE_ERRORS as exc:
        raise RejectError("bad_image", f"EXIF orientation cannot be applied ({exc})") from None
    return to_rgb(image)


def _load_strict(image: Image.Image) -> None:
    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with _own_pixel_limit():
            image.load()
    except _DECODE_ERRORS as exc:
        raise RejectError("bad_image", f"{image.format or 'image'} does not decode: {exc}") from None
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = previous


def to_rgb(image: Image.Image) -> Image.Image:
    """Rules 2-4 of the module docstring: any PIL mode -> RGB."""
    if image.mode in _HIGH_BIT_DEPTH_MODES:
        return _high_bit_depth_to_rgb(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    try:
        return image.convert("RGB")
    except ValueError as exc:  # e.g. LAB: PIL has no conversion
        raise RejectError("unsupported_mode", f"image mode {image.mode} cannot be converted to RGB ({exc})") from None


def _high_bit_depth_to_rgb(image: Image.Image) -> Image.Image:
    values = np.asarray(image)
    if image.mode == "F":
        grey = np.rint(np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0) * 255.0).astype(np.uint8)
    else:
        if image.mode == "I":
            values = np.clip(values, 0, 65535)
        # round(v / 257) without floats; never a tie, since 257 is odd
        grey = ((values.astype(np.uint32) * 2 + 257) // 514).astype(np.uint8)
        transparent = image.info.get("transparency")
        if isinstance(transparent, int):
            grey[values == transparent] = 255
    return Image.fromarray(np.repeat(grey[:, :, None], 3, axis=2), "RGB")


# ---------------------------------------------------------------------------------------
# RGB image -> patches


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """HF's `smart_resize`, same arithmetic (Python round = half to even), reject instead of raise.

    Both sides become multiples of `factor`, the area lands in [min_pixels, max_pixels]
    where possible, the aspect ratio is kept as closely as the rounding allows.
    """
    if min(height, width) <= 0 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RejectError(
            "aspect_ratio",
            f"image {width}x{height}: aspect ratio must be at most {MAX_ASPECT_RATIO} "
            "(the Qwen-VL image processor refuses it)",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_to_patches(image: Image.Image, vision: VisionConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """RGB image -> (`pixel_patches` uint8 [gh*gw, C*P*P], grid (1, gh, gw)).

    Resized with PIL BICUBIC on uint8, exactly as `Qwen2VLImageProcessorPil` does, then cut
    into patches in HF's row order (merge blocks of m*m consecutive rows, each block one LLM
    token) with columns (c, py, px): HF's `pixel_values` row minus the temporal repeat and
    the normalisation, which `shards_schema.pixels` adds back.
    """
    if image.mode != "RGB":
        raise ValueError(f"image_to_patches needs an RGB image (use decode_image), got mode {image.mode}")
    height, width = smart_resize(
        image.height, image.width, vision.resize_factor, vision.min_pixels, vision.max_pixels
    )
    resized = image.resize((width, height), Image.Resampling.BICUBIC)
    planes = np.empty((1, vision.channels, height, width), dtype=np.uint8)
    for k, band in enumerate(resized.split()):  # PIL splits the interleaved RGB in C
        planes[0, k] = np.asarray(band)
    patches = planes_to_rows(planes, vision.patch_size, vision.merge_size)
    return patches, (1, height // vision.patch_size, width // vision.patch_size)


def header_grid(image: Image.Image, vision: VisionConfig) -> tuple[int, int, int]:
    """The patch grid (1, gh, gw) of an opened image from its header size, before decoding.

    The EXIF orientation may swap the decoded image's sides, which swaps gh and gw (smart_resize
    treats both sides alike) and keeps the token count gh * gw / merge_size**2.
    """
    height, width = smart_resize(image.height, image.width, vision.resize_factor, vision.min_pixels, vision.max_pixels)
    return 1, height // vision.patch_size, width // vision.patch_size


def open_image_source(
    source: str,
    media_root: Path | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    remote: FetchPolicy | None = None,
) -> Image.Image:
    """Image reference of a chat part -> a header-checked image (`open_image`), pixels not decoded."""
    data = resolve_image_source(source, media_root, max_media_bytes, remote)
    return open_image(data, max_image_pixels=max_image_pixels, declared=declared_type(source))


def load_image_patches(
    source: str,
    vision: VisionConfig,
    media_root: Path | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Image reference of a chat part -> (`pixel_patches`, grid): the whole per-image path."""
    image = open_image_source(source, media_root, max_image_pixels, max_media_bytes)
    return image_to_patches(decode_opened(image), vision)
