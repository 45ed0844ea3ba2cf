"""Images for tests: random ones in every mode and format, and PNGs whose header claims a size
their pixels are never decoded at."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image, ImageOps

from preprocess.examples import synthetic_image

MODES = ("RGB", "RGB", "RGBA", "L", "P", "LA", "CMYK")


def encoded_image(nprng: np.random.Generator) -> tuple[bytes, Image.Image]:
    """Random size/mode/format image: its encoded bytes and what HF's processor is given."""
    w, h = (int(v) for v in nprng.integers(9, 700, 2))
    mode = MODES[int(nprng.integers(len(MODES)))]
    img = synthetic_image(nprng, w, h, "RGBA" if mode in ("RGBA", "LA") else "RGB")
    img = img.convert(mode) if mode != "RGBA" else img
    fmt = {"CMYK": "JPEG", "LA": "PNG", "RGBA": "PNG", "P": "PNG"}.get(mode, ["PNG", "JPEG", "WEBP"][int(nprng.integers(3))])
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    data = buf.getvalue()
    return data, ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


def png_header_only(width: int, height: int, bit_depth: int = 1, colour_type: int = 0) -> bytes:
    """A PNG whose header claims width x height (default 1-bit greyscale; colour type 6 = RGBA),
    with a tiny IDAT: costs nothing to build, and fails if anything decodes its pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")

