"""Image path oracle tests: our uint8 patches + GPU-side LUT == Qwen2VLImageProcessorPil, bit for bit.

HF is given what a user would hand it: the decoded PIL image (`Image.open` + EXIF
transpose, mode untouched), so its own alpha compositing and RGB conversion are exercised.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import socket
import subprocess
import sys
import threading
from functools import lru_cache

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from preprocess.errors import RejectError
from preprocess.images import (
    REJECT_CODES,
    decode_image,
    decode_opened,
    header_grid,
    image_to_patches,
    load_image_patches,
    open_image,
    resolve_image_source,
    smart_resize,
    to_rgb,
)
from preprocess.media import media_file
from shards_schema.builtin import QWEN2_5_VL_VISION, QWEN3_VL_VISION, VisionConfig
from shards_schema.pixels import normalization_lut, pixel_values_from_patches
from tests.helpers.images import png_header_only

VISIONS = {"qwen3-vl": QWEN3_VL_VISION, "qwen2.5-vl": QWEN2_5_VL_VISION}


@pytest.fixture(params=sorted(VISIONS))
def vision(request) -> VisionConfig:
    return VISIONS[request.param]


@lru_cache(maxsize=None)
def hf_processor(vision: VisionConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        image_mean=list(vision.image_mean),
        image_std=list(vision.image_std),
        min_pixels=vision.min_pixels,
        max_pixels=vision.max_pixels,
    )


def hf_pixels(image: Image.Image, vision: VisionConfig) -> tuple[np.ndarray, tuple[int, ...]]:
    out = hf_processor(vision)(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])


def hf_open(data: bytes) -> Image.Image:
    """What a user hands HF: the decoded file, EXIF applied, mode untouched."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


def our_pixels(patches: np.ndarray, vision: VisionConfig, dtype=None) -> torch.Tensor:
    return pixel_values_from_patches(
        torch.from_numpy(patches),
        vision.image_mean,
        vision.image_std,
        vision.patch_size,
        vision.temporal_patch_size,
        vision.channels,
        dtype=dtype,
    )


def encode(image: Image.Image, fmt: str, **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# --------------------------------------------------------------------------- random oracle

SIZES = [(37, 1013), (301, 299), (1000, 17), (1, 1), (2, 3), (480, 640), (641, 479), (512, 512),
         (900, 700), (33, 65), (1500, 40), (123, 457), (720, 1280), (64, 64), (250, 251)]  # (h, w)
MODE_FORMATS = {
    "RGB": ("PNG", "JPEG", "WEBP"),
    "RGBA": ("PNG", "WEBP"),
    "LA": ("PNG",),
    "L": ("PNG", "JPEG"),
    "P": ("PNG", "GIF"),
    "P+transparency": ("PNG", "GIF"),
    "P+alpha-palette": ("PNG",),
    "CMYK": ("JPEG", "TIFF"),
}
SOURCE_KINDS = ("data_uri", "base64", "relative_path", "absolute_path")
CASES_PER_PROFILE = 22


def random_content(rng: np.random.Generator, h: int, w: int, channels: int) -> np.ndarray:
    """Noise (worst case for resampling) or smooth gradients with a few edges (photo-like)."""
    if rng.random() < 0.5:
        return rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    planes = []
    for _ in range(channels):
        fy, fx, phase = rng.uniform(0.001, 0.05, 2).tolist() + [rng.uniform(0, 6.3)]
        plane = 127.5 + 127.5 * np.sin(fy * yy + fx * xx + phase)
        plane[(yy // max(1, h // 3) + xx // max(1, w // 4)) % 2 == 1] *= 0.6
        planes.append(plane)
    return np.rint(np.stack(planes, axis=-1)).astype(np.uint8)


def random_image(rng: np.random.Generator, h: int, w: int, mode: str) -> tuple[Image.Image, dict]:
    """A PIL image of `mode` plus the save() arguments that keep its transparency."""
    if mode in ("RGB", "RGBA", "CMYK"):
        bands = {"RGB": 3, "RGBA": 4, "CMYK": 4}[mode]
        return Image.fromarray(random_content(rng, h, w, bands), mode), {}
    if mode == "LA":
        return Image.fromarray(random_content(rng, h, w, 2), "LA"), {}
    if mode == "L":
        return Image.fromarray(random_content(rng, h, w, 1)[:, :, 0], "L"), {}
    image = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "P")
    image.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tobytes())
    if mode == "P+transparency":
        return image, {"transparency": int(rng.integers(0, 256))}
    if mode == "P+alpha-palette":
        return image, {"transparency": rng.integers(0, 256, 256, dtype=np.uint8).tobytes()}
    return image, {}


def random_case(case: int, vision: VisionConfig):
    """Case i: the i-th listed size (then random sizes), the i-th mode (cycling), the rest random."""
    rng = np.random.default_rng([case, vision.patch_size])
    if case < len(SIZES):
        h, w = SIZES[case]
    else:
        h, w = (int(x) for x in rng.integers(1, 1500, 2))
        w = max(w, h // 150 + 1)
        h = max(h, w // 150 + 1)
    mode = list(MODE_FORMATS)[case % len(MODE_FORMATS)]
    fmt = MODE_FORMATS[mode][int(rng.integers(len(MODE_FORMATS[mode])))]
    image, save_args = random_image(rng, h, w, mode)
    if fmt == "JPEG":
        save_args["quality"] = int(rng.integers(50, 96))
    if fmt == "WEBP":
        save_args["lossless"] = bool(rng.integers(2))
    # small bounds keep HF fast and make both the up- and the down-scaling branch run
    max_pixels = int(rng.choice([60_000, 120_000, 200_000]))
    min_pixels = int(rng.choice([vision.resize_factor**2, 4 * vision.resize_factor**2, 20_000]))
    bounded = dataclasses.replace(vision, min_pixels=min_pixels, max_pixels=max_pixels)
    kind = SOURCE_KINDS[int(rng.integers(len(SOURCE_KINDS)))]
    return encode(image, fmt, **save_args), bounded, kind, f"{mode}/{fmt} {h}x{w}"


def as_source(data: bytes, kind: str, media_root, name: str) -> str:
    if kind == "data_uri":
        return "data:image/whatever;base64," + b64(data)
    if kind == "base64":
        text = b64(data)
        return "\n".join(text[i : i + 76] for i in range(0, len(text), 76))  # MIME line breaks
    path = media_root / "imgs" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return str(path) if kind == "absolute_path" else f"imgs/{name}"


@pytest.mark.parametrize("case", range(CASES_PER_PROFILE))
def test_random_images_match_hf(vision, case, tmp_path):
    data, bounded, kind, label = random_case(case, vision)
    source = as_source(data, kind, tmp_path, f"case{case}")
    patches, grid = load_image_patches(source, bounded, media_root=tmp_path)
    expected, expected_grid = hf_pixels(hf_open(data), bounded)

    assert patches.dtype == np.uint8 and patches.flags.c_contiguous
    assert patches.shape == (grid[1] * grid[2], bounded.patch_row_width)
    assert grid == expected_grid, label
    ours = our_pixels(patches, bounded)
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), expected), label


def test_checkpoint_bounds_match_hf(vision):
    """The profiles' own (large) pixel bounds, no custom ones: one photo-sized image."""
    rng = np.random.default_rng(7)
    data = encode(Image.fromarray(random_content(rng, 333, 517, 3)), "JPEG", quality=90)
    patches, grid = load_image_patches(b64(data), vision)
    expected, expected_grid = hf_pixels(hf_open(data), vision)
    assert grid == expected_grid
    assert np.array_equal(our_pixels(patches, vision).numpy(), expected)


def test_bfloat16_equals_hf_cast(vision):
    rng = np.random.default_rng(3)
    data = encode(Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)), "PNG")
    bounded = dataclasses.replace(vision, min_pixels=4096, max_pixels=100_000)
    patches, _ = load_image_patches(b64(data), bounded)
    expected = torch.from_numpy(hf_pixels(hf_open(data), bounded)[0]).to(torch.bfloat16)
    ours = our_pixels(patches, bounded, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, expected)


def test_numpy_path_equals_torch_path(vision):
    patches = np.random.default_rng(5).integers(0, 256, (12, vision.patch_row_width), dtype=np.uint8)
    args = (vision.image_mean, vision.image_std, vision.patch_size, vision.temporal_patch_size)
    from_numpy = pixel_values_from_patches(patches, *args)
    assert isinstance(from_numpy, np.ndarray) and from_numpy.dtype == np.float32
    assert from_numpy.shape == (12, vision.pixel_values_row_width)
    assert np.array_equal(from_numpy, pixel_values_from_patches(torch.from_numpy(patches), *args).numpy())


def test_lut_equals_hf_rescale_normalize(vision):
    from transformers.image_transforms import normalize, rescale

    every_byte = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256))
    hf = normalize(rescale(every_byte, 1 / 255, input_data_format="channels_first"),
                   list(vision.image_mean), list(vision.image_std), input_data_format="channels_first")
    assert hf.dtype == np.float32
    assert np.array_equal(normalization_lut(vision.image_mean, vision.image_std), hf[:, 0, :])


def test_pixels_module_imports_without_torch():
    code = "import sys, shards_schema.pixels; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- colour rules


def test_16bit_grey_scaled_explicitly(vision):
    values = np.concatenate([np.arange(0, 65536, 64), [128, 129, 32767, 32768, 65535]]).astype(np.uint16)
    grey = np.resize(values, 96 * 128).reshape(96, 128)
    data = encode(Image.fromarray(grey), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    rgb = decode_image(data)
    expected = np.array([round(v / 257) for v in grey.ravel().tolist()], dtype=np.uint8).reshape(grey.shape)
    assert rgb.mode == "RGB"
    assert all(np.array_equal(np.asarray(rgb)[:, :, c], expected) for c in range(3))
    # after the colour rule, the rest of the path is HF's
    bounded = dataclasses.replace(vision, min_pixels=4096, max_pixels=50_000)
    patches, grid = image_to_patches(rgb, bounded)
    expected_pv, expected_grid = hf_pixels(rgb, bounded)
    assert grid == expected_grid and np.array_equal(our_pixels(patches, bounded).numpy(), expected_pv)


def test_32bit_int_and_float_modes():
    ints = Image.fromarray(np.array([[-5, 0, 257, 65535, 70000, 128]], dtype=np.int32))
    assert ints.mode == "I"
    assert np.asarray(to_rgb(ints))[0, :, 0].tolist() == [0, 0, 1, 255, 255, 0]
    floats = Image.fromarray(np.array([[-1.0, 0.0, 0.5, 1.0, 7.0, np.nan, 0.2]], dtype=np.float32))
    assert floats.mode == "F"
    assert np.asarray(to_rgb(floats))[0, :, 1].tolist() == [0, 0, 128, 255, 255, 0, 51]


def test_16bit_transparency_becomes_white():
    image = Image.fromarray(np.array([[0, 1000, 65535]], dtype=np.uint16))
    image.info["transparency"] = 1000
    assert np.asarray(to_rgb(image))[0, :, 2].tolist() == [0, 255, 255]


def test_alpha_composited_on_white():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255  # opaque red-ish, the rest fully transparent
    rgb = np.asarray(decode_image(encode(Image.fromarray(rgba), "PNG")))
    assert rgb[0, 0].tolist() == [200, 0, 0]
    assert (rgb.reshape(-1, 3)[1:] == 255).all()


def two_frames(fmt: str) -> bytes:
    frames = [Image.new("RGB", (20, 10), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, fmt, save_all=True, append_images=frames[1:])
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_images_are_rejected(fmt):
    """Which frame would be meant is unknown: an animation is refused, not cut to frame 0."""
    data = two_frames(fmt)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    with pytest.raises(RejectError) as err:
        decode_image(data)
    assert err.value.code == "animated_image"
    assert f"animated {fmt} with 2 frames; use one frame" in err.value.message and "video" in err.value.message


def test_multipage_tiff_uses_first_page():
    rgb = np.asarray(decode_image(two_frames("TIFF")))
    assert (rgb == [255, 0, 0]).all()


@pytest.mark.parametrize(
    "declared, fmt, ok",
    [
        ("image/png", "JPEG", False),
        ("image/jpeg", "PNG", False),
        ("image/gif", "WEBP", False),
        ("text/plain", "PNG", False),
        ("image/jpeg", "JPEG", True),
        ("image/jpg", "JPEG", True),
        ("image/pjpeg", "JPEG", True),
        ("image/*", "PNG", True),
        ("", "PNG", True),
        ("application/octet-stream", "WEBP", True),
        ("IMAGE/PNG", "PNG", True),
        ("image/x-portable-anymap", "PPM", True),
        ("image/undefined", "JPEG", True),
        ("image/apng", "PNG", True),
        ("image/avif", "PNG", False),
    ],
)
def test_data_uri_type_must_match_the_bytes(declared, fmt, ok):
    data = encode(Image.new("RGB", (8, 8), (1, 2, 3)), fmt)
    source = f"data:{declared};base64," + b64(data)
    if ok:
        assert load_image_patches(source, QWEN3_VL_VISION)[0].shape[0] > 0
        return
    with pytest.raises(RejectError) as err:
        load_image_patches(source, QWEN3_VL_VISION)
    assert err.value.code == "mime_mismatch"
    assert f"says {declared}" in err.value.message and Image.MIME[fmt] in err.value.message


def test_exif_orientation_applied(vision):
    rng = np.random.default_rng(11)
    raw = random_content(rng, 200, 320, 3)  # h=200, w=320
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = encode(Image.fromarray(raw), "JPEG", quality=95, exif=exif.tobytes())
    stored = np.asarray(Image.open(io.BytesIO(data)))
    assert stored.shape[:2] == (200, 320)

    rgb = decode_image(data)
    assert rgb.size == (200, 320)  # (w, h): transposed
    assert np.array_equal(np.asarray(rgb), np.rot90(stored, k=-1))

    bounded = dataclasses.replace(vision, min_pixels=4096, max_pixels=100_000)
    _, grid = load_image_patches(b64(data), bounded)
    _, raw_grid = image_to_patches(Image.fromarray(stored), bounded)
    assert grid == (1, raw_grid[2], raw_grid[1]) and grid[1] != grid[2]
    patches, grid = load_image_patches(b64(data), bounded)
    expected, expected_grid = hf_pixels(hf_open(data), bounded)
    assert grid == expected_grid and np.array_equal(our_pixels(patches, bounded).numpy(), expected)


# --------------------------------------------------------------------------- smart_resize


def test_smart_resize_matches_hf_sweep():
    rng = np.random.default_rng(2024)
    bounds = [(65536, 16777216), (3136, 12845056), (4096, 200_000), (1, 10**9), (50_000, 50_000)]
    checked = rejected = 0
    for factor in (28, 32, 14, 16):
        sides = np.concatenate([
            rng.integers(1, 64, 300), rng.integers(1, 3000, 600), rng.integers(1, 20000, 200),
            (factor * (np.arange(1, 60) + 0.5)).astype(int) if factor % 2 == 0 else [],  # x.5 ties
        ]).astype(int)
        for _ in range(1250):
            h, w = (int(x) for x in rng.choice(sides, 2))
            min_px, max_px = bounds[int(rng.integers(len(bounds)))]
            try:
                expected = hf_smart_resize(h, w, factor, min_px, max_px)
            except ValueError:
                with pytest.raises(RejectError) as info:
                    smart_resize(h, w, factor, min_px, max_px)
                assert info.value.code == "aspect_ratio"
                rejected += 1
                continue
            assert smart_resize(h, w, factor, min_px, max_px) == expected, (h, w, factor, min_px, max_px)
            checked += 1
    assert checked + rejected == 5000 and rejected > 0


def test_smart_resize_rounds_half_to_even():
    # 48/32 = 1.5 -> 2, 80/32 = 2.5 -> 2 (banker's rounding), as in HF
    assert smart_resize(48, 80, 32, 1, 10**9) == (64, 64) == hf_smart_resize(48, 80, 32, 1, 10**9)


# --------------------------------------------------------------------------- rejects


def reject_code(fn, *args, **kwargs) -> str:
    with pytest.raises(RejectError) as info:
        fn(*args, **kwargs)
    assert info.value.message
    return info.value.code


@pytest.fixture(scope="module")
def jpeg_bytes() -> bytes:
    rng = np.random.default_rng(1)
    return encode(Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)), "JPEG")


@pytest.fixture(scope="module")
def png_bytes() -> bytes:
    rng = np.random.default_rng(2)
    return encode(Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)), "PNG")


def test_reject_bad_base64():
    assert reject_code(resolve_image_source, "data:image/png;base64,iVBOR!!not*base64", None) == "bad_base64"
    assert reject_code(resolve_image_source, "A" * 301, None) == "bad_base64"  # 301 % 4 == 1: no padding fixes it
    assert reject_code(resolve_image_source, "data:image/png,rawbytes", None) == "bad_data_uri"


def test_an_image_features_bytes_given_as_text_are_read_as_base64_never_as_a_path(png_bytes, tmp_path):
    """{"bytes": "...", "path": ...} with text bytes (as a JSON export writes them): base64, even
    short or beside a path that exists; text that is no base64 is rejected naming the feature."""
    (tmp_path / "cat.png").write_bytes(b"not this file")
    for text in (b64(png_bytes), base64.urlsafe_b64encode(png_bytes).decode().rstrip("=")):
        assert resolve_image_source({"bytes": text, "path": "cat.png"}, tmp_path) == png_bytes
    with pytest.raises(RejectError) as info:
        resolve_image_source({"bytes": "cat.png", "path": None}, tmp_path)
    assert info.value.code == "bad_base64" and info.value.message.startswith(
        "the `bytes` of the image feature are text, read as base64: image base64 does not decode"), info.value
    assert info.value.message.endswith("give the encoded bytes, or their base64")
    assert resolve_image_source({"bytes": None, "path": "cat.png"}, tmp_path) == b"not this file"  # images: read whole


def test_base64_missing_padding_and_urlsafe(png_bytes):
    text = base64.urlsafe_b64encode(png_bytes).decode().rstrip("=")
    assert resolve_image_source(text, None) == png_bytes
    tiny = encode(Image.new("RGB", (1, 1)), "PNG")
    assert len(b64(tiny)) < 256 and resolve_image_source(b64(tiny), None) == tiny  # short, but PNG magic


@pytest.mark.parametrize("keep", [0.5, 0.9])
@pytest.mark.parametrize("extra", [0, 1, 2, 3])
def test_truncated_base64_is_rejected(jpeg_bytes, keep, extra):
    """A base64 string cut anywhere: either no longer base64, or a truncated image."""
    b64 = base64.b64encode(jpeg_bytes).decode()
    cut = b64[: int(len(b64) * keep) // 4 * 4 + extra]
    code = reject_code(load_image_patches, "data:image/jpeg;base64," + cut, QWEN3_VL_VISION)
    assert code in ("bad_base64", "bad_image"), code


def test_reject_undecodable_bytes(jpeg_bytes, png_bytes):
    assert reject_code(decode_image, jpeg_bytes[: len(jpeg_bytes) // 2]) == "bad_image"
    assert reject_code(decode_image, png_bytes[: len(png_bytes) // 2]) == "bad_image"
    assert reject_code(decode_image, np.random.default_rng(0).bytes(5000)) == "not_an_image"
    assert reject_code(decode_image, b"") == "not_an_image"
    with pytest.raises(RejectError, match=r"^not_an_image: the image is empty \(0 bytes\)$"):
        decode_image(b"")


def test_reject_too_large(jpeg_bytes):
    assert reject_code(decode_image, png_header_only(20000, 20000)) == "image_too_large"  # PIL's hard limit
    assert reject_code(decode_image, png_header_only(5000, 5000), max_image_pixels=10**6) == "image_too_large"
    assert reject_code(decode_image, jpeg_bytes, max_image_pixels=160 * 120 - 1) == "image_too_large"
    assert decode_image(jpeg_bytes, max_image_pixels=160 * 120).size == (160, 120)


def test_decoded_bytes_are_bounded():
    """Pixels under --max-image-pixels, but 4 bytes each: over the decode cap of 3 bytes per
    allowed pixel. Refused from the header, with the memory a decode would take."""
    with pytest.raises(RejectError) as err:
        open_image(png_header_only(1000, 1000, 8, 6), max_image_pixels=1_200_000)
    assert err.value.code == "image_too_large"
    assert "1000x1000 RGBA = 1000000 pixels, 4000000 bytes decoded" in err.value.message
    assert "3600000 bytes decoded" in err.value.message
    # the same header as 8-bit greyscale (1 byte a pixel) passes the header checks
    assert open_image(png_header_only(1000, 1000, 8, 0), max_image_pixels=1_200_000).size == (1000, 1000)


@pytest.mark.parametrize("side", [14_000, 20_000, 100_000])
def test_max_image_pixels_is_the_only_pixel_limit(side):
    """--max-image-pixels decides alone, above PIL's own decompression-bomb limit too (2 *
    Image.MAX_IMAGE_PIXELS): a raised limit lets a larger header through, and a refusal names the
    flag's limit, not PIL's. PIL's setting is left as it was."""
    pil_limit = Image.MAX_IMAGE_PIXELS
    header = png_header_only(side, side)  # 1-bit greyscale: 1 byte a pixel decoded
    assert open_image(header, max_image_pixels=side * side).size == (side, side)
    with pytest.raises(RejectError) as err:
        open_image(header, max_image_pixels=side * side - 1)
    assert err.value.code == "image_too_large"
    assert f"--max-image-pixels {side * side - 1}" in err.value.message
    assert Image.MAX_IMAGE_PIXELS == pil_limit


def test_header_grid_is_the_decoded_grid(vision, jpeg_bytes):
    image = open_image(jpeg_bytes)
    assert header_grid(image, vision) == image_to_patches(decode_opened(image), vision)[1]


def test_reject_aspect_ratio(vision):
    data = encode(Image.new("RGB", (600, 2), (10, 20, 30)), "PNG")
    assert reject_code(load_image_patches, b64(data), vision) == "aspect_ratio"


@pytest.mark.parametrize("url", ["http://x.org/a.jpg", "https://x.org/a.png", "ftp://h/a.png", "s3://b/k.jpg"])
def test_reject_remote_url(url, tmp_path):
    assert reject_code(resolve_image_source, url, tmp_path) == "remote_url"
    assert "--media-root" in pytest.raises(RejectError, resolve_image_source, url, None).value.message


def test_paths_confined_to_media_root(tmp_path, png_bytes):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "ok.png").write_bytes(png_bytes)
    (tmp_path / "secret.png").write_bytes(png_bytes)
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "inside.png").symlink_to(root / "sub" / "ok.png")

    assert resolve_image_source("sub/ok.png", root) == png_bytes
    assert resolve_image_source(str(root / "sub" / "ok.png"), root) == png_bytes
    assert resolve_image_source("inside.png", root) == png_bytes
    assert resolve_image_source("sub/../sub/ok.png", root) == png_bytes
    assert resolve_image_source((root / "sub" / "ok.png").as_uri(), root) == png_bytes
    assert reject_code(resolve_image_source, "../secret.png", root) == "path_outside_media_root"
    assert reject_code(resolve_image_source, "sub/../../secret.png", root) == "path_outside_media_root"
    assert reject_code(resolve_image_source, "escape.png", root) == "path_outside_media_root"
    assert reject_code(resolve_image_source, str(tmp_path / "secret.png"), root) == "path_outside_media_root"
    assert reject_code(resolve_image_source, "sub/missing.png", root) == "missing_file"
    assert reject_code(resolve_image_source, "sub/ok.png", None) == "no_media_root"
    assert "--media-root" in pytest.raises(RejectError, resolve_image_source, "a.png", None).value.message
    assert reject_code(resolve_image_source, "   ", root) == "empty_source"
    # a short base64 string is read as a path: the message says how to give it as base64
    short = base64.b64encode(b"not an image, and short").decode()
    for source, where in ((short, None), (short, root)):
        message = pytest.raises(RejectError, resolve_image_source, source, where).value.message
        assert "give it as a data URI (data:image/...;base64,...)" in message, message
    assert "data URI" not in pytest.raises(RejectError, resolve_image_source, "a_long_file_name.png", None).value.message


def returns_within(seconds: float, fn, *args, **kwargs):
    """fn's result or RejectError, failing the test (not hanging it) if fn blocks."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except RejectError as exc:
            outcome["value"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} blocked for {seconds} s"
    return outcome["value"]


def test_only_regular_files_are_read(tmp_path, png_bytes):
    root = tmp_path / "media"
    root.mkdir()
    os.mkfifo(root / "pipe.jpg")  # reading it would block forever: no writer
    (root / "dir.png").mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(root / "sock.png"))
    (root / "link.png").symlink_to(root / "pipe.jpg")
    try:
        for name, kind in [("pipe.jpg", "FIFO"), ("link.png", "FIFO"), ("dir.png", "directory"), ("sock.png", "socket")]:
            exc = returns_within(10, resolve_image_source, name, root)
            assert isinstance(exc, RejectError) and exc.code == "not_a_regular_file", (name, exc)
            assert kind in exc.message and "only regular files" in exc.message
    finally:
        server.close()


def test_media_file_size_is_capped_before_reading(tmp_path, png_bytes):
    root = tmp_path / "media"
    root.mkdir()
    with open(root / "huge.jpg", "wb") as fh:  # sparse: 3 GiB that take no disk and must take no memory
        fh.truncate(3 * 2**30)
    exc = returns_within(10, resolve_image_source, "huge.jpg", root)
    assert exc.code == "media_too_large" and f"has {3 * 2**30} bytes" in exc.message
    assert "--max-media-bytes 134217728" in exc.message
    (root / "ok.png").write_bytes(png_bytes)
    assert resolve_image_source("ok.png", root, max_media_bytes=len(png_bytes)) == png_bytes
    assert reject_code(resolve_image_source, "ok.png", root, max_media_bytes=len(png_bytes) - 1) == "media_too_large"


def test_base64_size_is_capped_before_decoding(png_bytes):
    text = b64(png_bytes)
    cap = len(png_bytes)
    for source in ("data:image/png;base64," + text, text):
        assert resolve_image_source(source, None, max_media_bytes=cap) == png_bytes
        with pytest.raises(RejectError) as err:
            resolve_image_source(source, None, max_media_bytes=cap - 3)
        assert err.value.code == "media_too_large" and "--max-media-bytes" in err.value.message
    wrapped = "\n".join(text[i : i + 4] for i in range(0, len(text), 4))  # whitespace is not data
    assert resolve_image_source(wrapped, None, max_media_bytes=cap) == png_bytes


def test_every_reject_code_is_exercised(tmp_path, monkeypatch):
    """Each code of preprocess.images.REJECT_CODES is produced by one of the calls below."""
    png = encode(Image.new("RGB", (16, 12), (9, 8, 7)), "PNG")
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(png)

    def permission_denied(*args, **kwargs):  # what a file without read permission gives (even as root)
        raise PermissionError(13, "Permission denied")

    def unreadable(root):
        with monkeypatch.context() as patch:
            patch.setattr(os, "open", permission_denied)
            return resolve_image_source("a.png", root)

    cases = {
        "empty_source": lambda: resolve_image_source("", root),
        "remote_url": lambda: resolve_image_source("https://x.org/a.png", root),
        "bad_data_uri": lambda: resolve_image_source("data:image/png,raw", root),
        "bad_base64": lambda: resolve_image_source("data:image/png;base64,!!", root),
        "no_media_root": lambda: resolve_image_source("a.png", None),
        "path_outside_media_root": lambda: resolve_image_source("../a.png", root),
        "bad_path": lambda: resolve_image_source("a\0.png", root),
        "missing_file": lambda: resolve_image_source("missing.png", root),
        "not_a_regular_file": lambda: resolve_image_source(".", root),
        "unreadable_file": lambda: unreadable(root),
        "media_too_large": lambda: resolve_image_source("a.png", root, max_media_bytes=len(png) - 1),
        "not_an_image": lambda: decode_image(b"not an image"),
        "mime_mismatch": lambda: decode_image(png, declared="image/gif"),
        "animated_image": lambda: decode_image(two_frames("GIF")),
        "image_too_large": lambda: decode_image(png, max_image_pixels=10),
        "bad_image": lambda: decode_image(png[:-30]),
        "unsupported_mode": lambda: to_rgb(Image.new("La", (2, 2))),
        "aspect_ratio": lambda: smart_resize(1, 300, 28, 1, 10**6),
    }
    assert set(cases) == set(REJECT_CODES)
    for code, call in cases.items():
        with pytest.raises(RejectError) as err:
            call()
        assert err.value.code == code, (code, err.value)
    (root / "loop.png").symlink_to(root / "loop.png")  # a symlink loop is a bad path, for images and videos
    for kind in ("image", "video"):
        with pytest.raises(RejectError) as err:
            media_file("loop.png", root, 10**6, kind)
        assert err.value.code == "bad_path" and "cannot be resolved" in str(err.value), err.value
