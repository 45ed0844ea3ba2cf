"""The fewest tokens a text can make, known before it is tokenized.

Tokenizing costs about 140 bytes of memory per byte of text (the `Encoding` keeps every
token's string, offsets and masks), so a text must be known to fit `--max-seq-len` before it
goes to the tokenizer. No token is longer than the vocabulary's longest entry, and the tokens
of a text spell its normalized bytes: a text of B bytes after the tokenizer's normalizer makes
at least ceil(B / longest) tokens. A text that makes more than `--max-seq-len` tokens by that
count alone is rejected (`too_long`) before it is tokenized; under `--truncate` only a head of
it, cut where the tokenizer would split it anyway, is tokenized (`head_end`).

Where the head may be cut: Qwen's tokenizer splits added (special) tokens out first, then
normalizes each piece (NFC), splits it with its pre-tokenizer regex and runs BPE within each
pre-token. A letter followed by whitespace or punctuation always ends a pre-token of that
regex: the letter belongs to a letter run (`\\p{L}+`) or a contraction (`'s`), which ends
there whatever follows, and the next pre-token begins at the following character. Cut just
after such a letter (one NFC leaves alone and no following character can combine with, outside
any added token), the head's tokens are the whole text's first tokens, id for id
(`tests/test_bad_rows.py` checks this against the tokenizer on random texts). For a tokenizer
with another pre-tokenizer no head is cut: the row is rejected instead.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

UTF8_CHUNK_CHARS = 1 << 20  # a non-ASCII text is measured in pieces of this many characters, never copied whole
MAX_NFC_GROWTH = 3  # NFC makes a text at most 3x longer in UTF-8 bytes (Unicode's normalization stability policy)
MIN_LONGEST_TOKEN_BYTES = len("<|vision_start|>")  # every Qwen-VL vocabulary has it (Profile.special checks)
HEAD_CUT_WINDOW = 1 << 16  # characters searched for a place to cut after the head's least length
QWEN_PRETOKENIZER = (
    b'{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"(?i:\'s|\'t|\'re|\'ve|\'m|\'ll|\'d)|'
    b'[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|'
    b'\\\\s+(?!\\\\S)|\\\\s+"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,'
    b'"trim_offsets":false,"use_regex":false}]}'
)
# A cut goes after a letter and before one of these: whitespace or punctuation that no NFC
# composition takes as its second character, and that no letter run continues into.
_CUT_BEFORE = re.compile(r"(?<=\w)(?=[ \t\r\n.,;:!?()\[\]{}\"'，。！？、；：（）「」])")
_CONJOINING_JAMO = ((0x1100, 0x11FF), (0xA960, 0xA97F), (0xD7B0, 0xD7FF))  # letters NFC composes with a neighbour


def utf8_length(text: str) -> int:
    """len(text.encode("utf-8")) without a copy of a long text."""
    if text.isascii():
        return len(text)
    return sum(len(text[at : at + UTF8_CHUNK_CHARS].encode("utf-8", "surrogatepass"))
               for at in range(0, len(text), UTF8_CHUNK_CHARS))


def _normalizer_kind(tokenizer) -> str:
    normalizer = tokenizer.normalizer
    if normalizer is None:
        return "none"
    return "NFC" if normalizer.__getstate__() == b'{"type":"NFC"}' else "other"


def might_exceed(text: str, max_tokens: int, tokenizer) -> bool:
    """False when `text` certainly makes at most `max_tokens` tokens by its length alone, known
    without the vocabulary: it has at most 4 bytes a character, NFC makes it at most 3x longer,
    and every Qwen-VL vocabulary holds a token of 16 bytes (<|vision_start|>), so its longest is
    at least that long."""
    if _normalizer_kind(tokenizer) == "other":
        return True
    return 4 * MAX_NFC_GROWTH * len(text) > MIN_LONGEST_TOKEN_BYTES * max_tokens


@dataclass(frozen=True)
class TextBudget:
    """What a tokenizer's texts cost in tokens, at least (see the module docstring)."""

    longest_token_bytes: int  # no token spells more bytes (added tokens included)
    normalizer: str  # "none", "NFC" or "other" (measured by running it)
    added_tokens: tuple[str, ...]  # a cut never falls inside one
    exact_head: bool  # the pre-tokenizer is Qwen's, so `head_end` cuts where the whole text's tokens split

    @classmethod
    def of(cls, tokenizer) -> "TextBudget":
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        # A byte-level token's characters stand for one byte each; other vocabularies are measured
        # in UTF-8, which is never less than the bytes their decoders write (▁, <0x41>, ## ...).
        longest = max(map(len, vocab), default=1) if byte_level else max(
            (len(token.encode("utf-8")) for token in vocab), default=1)
        added = tuple(token.content for token in tokenizer.get_added_tokens_decoder().values())
        longest = max([longest, *(len(token.encode("utf-8")) for token in added)])
        kind = _normalizer_kind(tokenizer)
        pre = tokenizer.pre_tokenizer
        exact = (kind in ("none", "NFC") and type(tokenizer.model).__name__ == "BPE" and pre is not None
                 and pre.__getstate__() == QWEN_PRETOKENIZER)
        return cls(longest, kind, added, exact)

    def normalized_bytes(self, text: str, tokenizer) -> int:
        """The UTF-8 bytes of `text` after the tokenizer's normalizer (what its tokens spell)."""
        if self.normalizer == "none" or (self.normalizer == "NFC" and unicodedata.is_normalized("NFC", text)):
            return utf8_length(text)
        return utf8_length(tokenizer.normalizer.normalize_str(text))

    def fewest_tokens(self, text: str, tokenizer) -> int:
        return -(-self.normalized_bytes(text, tokenizer) // self.longest_token_bytes)

    def head_end(self, text: str, max_tokens: int, tokenizer) -> int | None:
        """An end q for a head text[:q] that makes more than `max_tokens` tokens, which are the
        whole text's first tokens id for id (q is len(text) when the text ends first); None when
        there is no such place: another pre-tokenizer, or no word end within HEAD_CUT_WINDOW
        characters after the least head."""
        if not self.exact_head:
            return None
        need = max_tokens * self.longest_token_bytes  # more normalized bytes than this make more tokens
        least = need + 1  # characters: at least as many bytes
        while least < len(text) and self.normalized_bytes(text[:least], tokenizer) <= need:
            least = min(len(text), 2 * least)  # NFC shrank the head (composed jamo, accents)
        window_end = least + HEAD_CUT_WINDOW
        for match in _CUT_BEFORE.finditer(text, min(least, len(text)), min(window_end, len(text))):
            if self._cuttable(text, match.start()):
                return match.start()
        return len(text) if window_end >= len(text) else None

    def _cuttable(self, text: str, q: int) -> bool:
        letter = text[q - 1]
        if not letter.isalpha() or not unicodedata.is_normalized("NFC", letter):
            return False
        if any(lo <= ord(letter) <= hi for lo, hi in _CONJOINING_JAMO):
            return False
        for token in self.added_tokens:
            # Found in this window, an occurrence covers q: the tokenizer splits it out whole there.
            if text.find(token, max(0, q - len(token) + 1), q + len(token) - 1) >= 0:
                return False
        return True
