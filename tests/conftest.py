"""The fixtures that several test modules use: the official chat templates (tests/fixtures/), the
built-in profiles, shards to train on. Shared helper code is in tests/helpers/."""

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures"
TEMPLATE_FILES = {
    "qwen3-vl": FIXTURES_DIR / "qwen3_vl_instruct.chat_template.jinja",
    "qwen2.5-vl": FIXTURES_DIR / "qwen2_5_vl_instruct.chat_template.jinja",
}
THINKING_TEMPLATE_FILE = FIXTURES_DIR / "qwen3_vl_thinking.chat_template.jinja"
FAMILIES = ("qwen3-vl", "qwen2.5-vl")


@pytest.fixture(scope="session", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="session")
def builtin_profiles():
    from preprocess.profiles import builtin_profile

    return {name: builtin_profile(name) for name in FAMILIES}


@pytest.fixture(scope="session")
def official_template():
    """family -> the official template text (ground truth for the renderer)."""
    return {name: path.read_text(encoding="utf-8") for name, path in TEMPLATE_FILES.items()}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Shards of 24 example rows (Qwen3-VL) made by `vlmpack preprocess`, once per module."""
    from tests.helpers.shards import preprocess

    return preprocess(tmp_path_factory.mktemp("train-data"), "shards")


@pytest.fixture(scope="module")
def hf_tokenizers(builtin_profiles, tmp_path_factory):
    """HF tokenizers built from exactly the profile's tokenizer.json."""
    from transformers import AutoTokenizer

    tokenizers = {}
    for family, profile in builtin_profiles.items():
        directory = tmp_path_factory.mktemp(family)
        (directory / "tokenizer.json").write_text(profile.tokenizer_json, encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        tokenizers[family] = AutoTokenizer.from_pretrained(str(directory))
    return tokenizers


@pytest.fixture(scope="module")
def hf_image_processors(builtin_profiles):
    """family -> HF's PIL image processor with the profile's vision settings."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = {}
    for family, profile in builtin_profiles.items():
        v = profile.vision
        out[family] = Qwen2VLImageProcessorPil(
            patch_size=v.patch_size, merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size,
            image_mean=list(v.image_mean), image_std=list(v.image_std), min_pixels=v.min_pixels, max_pixels=v.max_pixels,
        )
    return out


@pytest.fixture(scope="module")
def info():
    """One CPU process group (TP=1, PP=1) for the module's models, destroyed after its tests."""
    from train.parallel import destroy_parallel, init_parallel

    info = init_parallel(1, 1, device="cpu")
    yield info
    destroy_parallel()
