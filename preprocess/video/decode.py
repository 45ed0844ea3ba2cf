"""Video container -> the RGB frames at given indices, with PyAV (FFmpeg's decoders, as a wheel).

Frame `i` is the i-th frame the decoder outputs from the start of the stream, in presentation
order, and its pixels are `frame.to_ndarray(format="rgb24")` (turned upright, below): exactly
what `transformers.video_utils.load_video(..., backend="pyav")` gives, which decodes the whole
stream from the start and keeps the frames it wants.

Opening a video reads the container's packets (demuxing only, no decoding) to learn each
frame's presentation time and which frames are keyframes. Reading frames then seeks to the
last keyframe at or before each wanted frame and decodes forward from there, matching frames
by presentation time: a 10-minute video sampled at 2 fps decodes a few frames per sample
instead of every frame. At most one decoded frame and its RGB copy are held at a time.

A stream whose packets carry no timestamps, or repeat one (a muxer that wrote 0 for every frame),
is decoded sequentially instead (no seeking).

A file FFmpeg cannot open, or opens without a usable video stream, is told apart from one that
is not a video by its first bytes: an MP4 / QuickTime file (whose top-level boxes are walked:
one running past the end of the file, or no `moov` index, is a cut-off download), a Matroska /
WebM or an AVI file is `bad_video` (damaged) rather than `not_a_video` or `no_video_stream`.

Rotation metadata (the container's display matrix, as phones write it) is applied: frames
come out upright, as players show them and as Hugging Face's default video decoder
(torchcodec) returns them, and `info` reports the upright width and height. FFmpeg's reported
angle is counter-clockwise and is rounded to a multiple of 90 degrees; the frame is turned
with `np.rot90`, a lossless permutation of its pixels.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RejectError
from ..media import MIN_FPS

# FFmpeg's demuxers of single still images (image2 and its *_pipe family): such a "video" is
# a picture with a made-up frame rate.
_STILL_IMAGE_FORMATS = ("image2", "image2pipe")
# FFmpeg's demuxers of animated images: a file of them holding one frame is a still picture.
_ANIMATED_IMAGE_FORMATS = ("gif", "apng")


@dataclass(frozen=True)
class VideoInfo:
    """What the container says, and what demuxing it found."""

    total_frames: int  # frames in the stream (demuxed packets that carry a picture)
    fps: float  # the stream's average frame rate (what HF's pyav reader reports)
    width: int
    height: int
    codec: str
    container: str
    rotation: int = 0  # counter-clockwise quarter turns applied to each decoded frame (0-3)


_SNIFF_BYTES = 4096
# Lists of other files or streams FFmpeg would open (by the first bytes its own probes look for)
_LISTS_OF_OTHER_FILES = (
    ("an HLS playlist (#EXTM3U)", lambda head: head.startswith(b"#EXTM3U")),
    ("a DASH manifest (<MPD>)", lambda head: head.startswith(b"<") and b"<MPD" in head),
    ("an FFmpeg concat list (ffconcat)", lambda head: head.startswith(b"ffconcat version")),
    ("an SDP session description (v=0)", lambda head: head.startswith(b"v=0")),
)


def _av():
    try:
        import av
    except ImportError:  # pragma: no cover - the video extra is a declared dependency
        raise RejectError("no_video_decoder", "video input needs PyAV: pip install 'vlmpack[video]'") from None
    return av


class VideoReader:
    """An opened video: `info`, then `frames(indices)`. Use as a context manager.

    Before any frame is decoded, the container's header is checked: a video stream with a
    decoder, a frame rate of at least MIN_FPS, not a still image, an index holding no more
    frames than the file does, and frames of at most `max_frame_pixels` pixels
    (`frame_too_large`), so the one frame decoded to read the rotation, and every frame after
    it, has bounded size."""

    def __init__(self, source: Path | bytes, *, what: str = "video", max_frame_pixels: int | None = None):
        av = _av()
        self._what = what
        self._source = source
        self._max_frame_pixels = max_frame_pixels
        self._frame_size: tuple[int, int] | None = None  # the last decoded frame's (width, height), checked
        self._refuse_by_first_bytes()
        try:
            self._container = av.open(str(source) if isinstance(source, Path) else io.BytesIO(source), mode="r",
                                      metadata_errors="ignore")
        except av.error.FFmpegError as exc:
            self._reject_if_damaged(f"FFmpeg cannot open it: {_reason(exc)}", opened=False)
            raise RejectError("not_a_video", f"{self._named()} cannot be opened as a video container "
                              f"({_reason(exc)})") from None
        try:
            self._open_stream(av)
        except BaseException:
            self._container.close()
            raise

    def _refuse_by_first_bytes(self) -> None:
        """An empty file, and a playlist or manifest (HLS, DASH, FFmpeg's concat list, an SDP
        session), which names other files or streams that FFmpeg opens while it opens the list:
        from outside --media-root, or a pipe or socket that never ends. Refused by its first
        bytes, before FFmpeg sees it."""
        if isinstance(self._source, Path):
            try:
                with open(self._source, "rb") as fh:
                    head = fh.read(_SNIFF_BYTES)
            except OSError:
                return  # FFmpeg's open names the failure
        else:
            head = self._source[:_SNIFF_BYTES]
        if not head:
            raise RejectError("not_a_video", f"{self._named()} is empty (0 bytes)")
        head = head.removeprefix(b"\xef\xbb\xbf").lstrip()
        for kind, matches in _LISTS_OF_OTHER_FILES:
            if matches(head):
                raise RejectError("not_a_video", f"{self._named()} is {kind}, which names other files or streams to "
                                  "read, not a video: give the video file itself")

    def _named(self) -> str:
        """`what`, with the file's path when it is a file (the row may name it relative to --media-root)."""
        return f"{self._what} file {str(self._source)[:160]!r}" if isinstance(self._source, Path) else self._what

    def _reject_if_damaged(self, symptom: str, opened: bool = True) -> None:
        """A `bad_video` RejectError when the source's structure says it is a damaged video
        container (`container_damage`), so the failure, `symptom`, is damage and not another
        kind of file; nothing otherwise."""
        try:
            damage = container_damage(self._source, opened=opened)
        except OSError:
            return  # cannot be read again: the caller's own reject stands
        if damage is not None:
            raise RejectError("bad_video", f"{self._named()} is a truncated or damaged {damage} ({symptom}); "
                              "download or encode it again")

    def _open_stream(self, av) -> None:
        streams = self._container.streams.video
        if not streams:
            kinds = ", ".join(s.type for s in self._container.streams) or "none"
            self._reject_if_damaged(f"no video stream is readable; streams: {kinds}")
            raise RejectError("no_video_stream", f"{self._named()} holds no video stream (streams: {kinds})")
        stream = self._stream = streams[0]
        if stream.codec_context is None:  # FFmpeg has no decoder for the codec, or could not read which it is
            self._reject_if_damaged("its video stream names no codec FFmpeg decodes")
            raise RejectError("unsupported_codec", f"{self._named()}: FFmpeg has no decoder for its video codec; "
                              "re-encode it (e.g. to H.264)")
        container_format = self._container.format.name
        if container_format in _STILL_IMAGE_FORMATS or container_format.endswith("_pipe"):
            raise RejectError("not_a_video", f"{self._what} is a still image ({container_format}), not a video: give it "
                              "as an image part, or its frames as a list of images")
        rate = stream.average_rate or stream.guessed_rate
        if not rate or float(rate) <= 0:
            raise RejectError("bad_video", f"{self._what}: the stream has no frame rate")
        if float(rate) < MIN_FPS:
            raise RejectError("bad_video", f"{self._what}: the stream's frame rate {float(rate):.3g} fps is below "
                              f"{MIN_FPS:g} (frames more than {1 / MIN_FPS:g} s apart)")
        self._check_frame_size(stream.codec_context.width, stream.codec_context.height)
        pts, keyframes, empty = [], [], 0
        try:
            for packet in self._container.demux(stream):
                if packet.size == 0:  # the demuxer's end-of-stream marker, or a dropped frame (AVI)
                    empty += packet.pts is not None
                    continue
                pts.append(packet.pts)
                keyframes.append(packet.is_keyframe)
        except av.error.FFmpegError as exc:
            raise RejectError("bad_video", f"{self._what}: the container is damaged ({_reason(exc)})") from None
        if not pts:
            raise RejectError("bad_video", f"{self._what}: the video stream holds no frames")
        if len(pts) == 1 and container_format in _ANIMATED_IMAGE_FORMATS:
            raise RejectError("not_a_video", f"{self._what} is a still image ({container_format} of one frame), not a "
                              "video: give it as an image part, or its frames as a list of images")
        if stream.frames > len(pts) + empty:
            # an index promising frames the file does not hold: a cut-off download, or a forged
            # index, on which FFmpeg's seeking can take minutes
            raise RejectError("bad_video", f"{self._what}: its header promises {stream.frames} frames but it holds "
                              f"{len(pts) + empty} (a truncated or damaged container)")
        if any(p is None for p in pts) or len(set(pts)) < len(pts):
            self._pts = None  # no timestamps that tell the frames apart to seek by: decode from the start
        else:
            order = np.argsort(np.asarray(pts, dtype=np.int64), kind="stable")
            self._pts = np.asarray(pts, dtype=np.int64)[order]
            self._key_pts = np.asarray(pts, dtype=np.int64)[np.asarray(keyframes, dtype=bool)]
            self._key_pts.sort()
            self._index_of = {int(p): i for i, p in enumerate(self._pts)}
        turns = self._display_quarter_turns(av)
        width, height = stream.codec_context.width, stream.codec_context.height
        if turns % 2:
            width, height = height, width
        self.info = VideoInfo(
            total_frames=len(pts), fps=float(rate), width=width, height=height, codec=stream.codec.name,
            container=self._container.format.name, rotation=turns,
        )

    def _display_quarter_turns(self, av) -> int:
        """Quarter turns from the display matrix, which FFmpeg attaches to decoded frames: one
        frame is decoded to read it."""
        try:
            self._container.seek(0)
            first = next(iter(self._decoded()), None)
        except av.error.FFmpegError as exc:
            raise RejectError("bad_video", f"{self._what}: decoding failed ({_reason(exc)})") from None
        if first is None:
            raise RejectError("bad_video", f"{self._what}: no frame decodes")
        return round(float(first.rotation or 0) / 90) % 4

    def _check_frame_size(self, width: int, height: int) -> None:
        if self._max_frame_pixels is not None and width * height > self._max_frame_pixels:
            raise RejectError("frame_too_large", f"{self._what}: frames of {width}x{height} = {width * height} pixels, "
                              f"over --max-image-pixels {self._max_frame_pixels}; shrink the video or raise "
                              "--max-image-pixels")

    def _rgb(self, frame) -> np.ndarray:
        rgb = frame.to_ndarray(format="rgb24")
        return np.ascontiguousarray(np.rot90(rgb, self.info.rotation)) if self.info.rotation else rgb

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._container.close()

    def frames(self, indices) -> Iterator[tuple[int, np.ndarray]]:
        """(index, RGB uint8 [H, W, 3]) for each of the non-decreasing `indices` (repeats allowed)."""
        av = _av()
        wanted = [int(i) for i in indices]
        if any(b < a for a, b in zip(wanted, wanted[1:])):
            raise ValueError("frame indices must be non-decreasing")
        if wanted and not 0 <= wanted[0] <= wanted[-1] < self.info.total_frames:
            raise ValueError(f"frame indices {wanted[0]}..{wanted[-1]} outside 0..{self.info.total_frames - 1}")
        try:
            yield from (self._sequential(wanted) if self._pts is None else self._seeking(wanted))
        except av.error.FFmpegError as exc:
            raise RejectError("bad_video", f"{self._what}: decoding failed ({_reason(exc)})") from None

    def _decoded(self) -> Iterator[object]:
        """The stream's frames from where the container stands. A stream may change its frame
        size mid-stream (WebRTC recordings, joined clips: each frame is resized to the plan's
        size), so every new size is checked against --max-image-pixels before the frame is
        converted: a header or first frame cannot vouch for the rest."""
        for frame in self._container.decode(self._stream):
            size = (frame.width, frame.height)
            if size != self._frame_size:
                self._check_frame_size(*size)
                self._frame_size = size
            yield frame

    def _sequential(self, wanted: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        self._container.seek(0)
        k, last = 0, None
        for i, frame in enumerate(self._decoded()):
            while k < len(wanted) and wanted[k] == i:
                if last is None or last[0] != i:
                    last = (i, self._rgb(frame))
                yield last
                k += 1
            if k == len(wanted):
                return
        self._missing(wanted[k])

    def _seeking(self, wanted: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        decoder, position, last = None, -1, None  # position: index of the last frame decoded
        for target in wanted:
            if last is not None and last[0] == target:
                yield last
                continue
            target_pts = int(self._pts[target])
            key = self._key_pts[max(int(np.searchsorted(self._key_pts, target_pts, side="right")) - 1, 0)]
            if decoder is None or self._index_of[int(key)] > position:
                self._container.seek(int(key), stream=self._stream, backward=True, any_frame=False)
                decoder = self._decoded()
                position = -1
            for frame in decoder:
                index = self._index_of.get(frame.pts, -1) if frame.pts is not None else -1
                if index < 0:
                    continue
                position = index
                if index == target:
                    last = (index, self._rgb(frame))
                    yield last
                    break
                if index > target:
                    self._missing(target)
            else:
                self._missing(target)

    def _missing(self, index: int) -> None:
        raise RejectError("bad_video", f"{self._what}: frame {index} of {self.info.total_frames} does not decode "
                          "(a truncated or damaged stream)")


def _reason(exc: Exception) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return str(text)[:160]


# ---------------------------------------------------------------------------------------------
# a video container's damage, from its bytes

_MP4_FIRST_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"styp")
_MP4_MAX_BOXES = 100_000  # a walk longer than this (a long fragmented file) leaves the verdict to FFmpeg
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"


def container_damage(source: Path | bytes, *, opened: bool) -> str | None:
    """What a video file's own structure says is wrong with it, or None. An MP4 / QuickTime
    file (ISO BMFF) whose top-level boxes run past the end of the file or hold no `moov` index
    is damaged whatever FFmpeg made of it; a Matroska / WebM or AVI file is damaged when FFmpeg
    could not open it (`opened` False), as its first bytes say it is a video container."""
    with (open(source, "rb") if isinstance(source, Path) else io.BytesIO(source)) as fh:
        size = fh.seek(0, io.SEEK_END)
        fh.seek(0)
        head = fh.read(12)
        if len(head) >= 8 and head[4:8] in _MP4_FIRST_BOXES:
            damage = _mp4_box_damage(fh, size)
            return None if damage is None else f"MP4 / QuickTime file: {damage}"
    if opened:
        return None
    if head.startswith(_EBML_MAGIC):
        return "Matroska / WebM file"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "AVI file"
    return None


def _mp4_box_damage(fh, size: int) -> str | None:
    """Where an ISO BMFF file's top-level boxes stop adding up: a box that runs past the end
    of the file (a cut-off download), a box of impossible size, or no `moov` box (the index
    of every frame, which FFmpeg needs to read any); None when none of these."""
    offset, seen = 0, set()
    for _ in range(_MP4_MAX_BOXES):
        if offset >= size:
            break
        fh.seek(offset)
        header = fh.read(16)
        if len(header) < 8:
            return f"it ends {size - offset} bytes into a box header at byte {offset:,}"
        box_size, kind = struct.unpack(">I", header[:4])[0], header[4:8].decode("latin-1")
        if box_size == 1:  # a 64-bit size follows the type
            if len(header) < 16:
                return f"it ends inside the `{kind}` box header at byte {offset:,}"
            box_size = struct.unpack(">Q", header[8:16])[0]
        elif box_size == 0:  # the last box, up to the end of the file
            box_size = size - offset
        if box_size < 8:
            return f"its `{kind}` box at byte {offset:,} has the impossible size {box_size}"
        if offset + box_size > size:
            return (f"its `{kind}` box at byte {offset:,} is {box_size:,} bytes long but the file ends "
                    f"{size - offset:,} bytes into it")
        seen.add(kind)
        offset += box_size
    else:
        return None
    if "moov" not in seen:
        return "it holds no `moov` box, the index a player needs to find any frame"
    return None
