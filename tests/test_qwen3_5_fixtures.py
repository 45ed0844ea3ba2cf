"""The Qwen3.5 / Qwen3.6 reference data: the vendored chat templates (their bytes, and the
rendering rules a native renderer must reproduce, shown through Hugging Face's own jinja
rendering), the processor constants, and the published config.json files (their bytes, how
transformers reads them, a shrunken model of each that runs, and the full-size parameter counts)."""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import re

import pytest

from preprocess.families import qwen3_5_constants as c35
from shards_schema.families import qwen3_5_tokenizer as q35
from tests.conftest import FIXTURES_DIR, REPO_ROOT

TEMPLATES = {
    "qwen3.5": FIXTURES_DIR / "qwen3_5.chat_template.jinja",
    "qwen3.6": FIXTURES_DIR / "qwen3_6.chat_template.jinja",
}
CONFIG_DIR = REPO_ROOT / "train" / "model" / "configs" / "qwen3_5"


def readme_rows(path, table_head):
    """The rows of the markdown table of `path` whose header line starts with `table_head`, as
    {first cell without backticks: [cells]}."""
    rows, inside = {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(table_head):
            inside = True
        elif inside and line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells
        elif inside and not line.startswith("|"):
            inside = False
    return rows


def render(name, messages, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    out = render_jinja_template(conversations=[messages], chat_template=TEMPLATES[name].read_text(encoding="utf-8"),
                                **kwargs)
    return out[0][0] if isinstance(out, tuple) else out[0]


# --- chat templates ---------------------------------------------------------------------------

def test_templates_are_the_published_bytes():
    rows = readme_rows(FIXTURES_DIR / "README.md", "| file | published with |")
    for path in TEMPLATES.values():
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == rows[path.name][3].strip("`"), path.name
        assert len(data) == int(rows[path.name][2]), path.name


def test_qwen3_6_differs_in_two_lines():
    a, b = (TEMPLATES[n].read_text(encoding="utf-8").splitlines() for n in ("qwen3.5", "qwen3.6"))
    changed = [line for line in difflib.unified_diff(a, b, n=0, lineterm="") if line[:1] in "+-"
               and not line.startswith(("+++", "---"))]
    assert len(changed) == 4
    assert any("preserve_thinking" in line for line in changed if line.startswith("+"))


CONVERSATION = [
    {"role": "system", "content": " Be brief. "},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "<think>\nlooking\n</think>\n\nA cat."},
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And this?"}]},
    {"role": "assistant", "reasoning_content": "watching", "content": "A dog.",
     "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"q": "dog", "n": 3, "ok": True}}}]},
    {"role": "tool", "content": "found"},
    {"role": "tool", "content": "more"},
]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendering_rules(name):
    bool_text = "True" if name == "qwen3.5" else "true"
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"  # content trimmed, no default system prompt
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"  # reasoning before the last user query dropped
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>And this?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nwatching\n</think>\n\nA dog.\n\n"
        "<tool_call>\n<function=search>\n<parameter=q>\ndog\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
        f"<parameter=ok>\n{bool_text}\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nfound\n</tool_response>\n<tool_response>\nmore\n</tool_response><|im_end|>\n"
    )
    assert render(name, CONVERSATION) == expected
    assert render(name, CONVERSATION, add_generation_prompt=True) == expected + "<|im_start|>assistant\n<think>\n"
    assert render(name, CONVERSATION, add_generation_prompt=True, enable_thinking=False) == (
        expected + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with_ids = render(name, CONVERSATION, add_vision_id=True)
    assert "Picture 1: <|vision_start|><|image_pad|>" in with_ids and "Video 1: <|vision_start|><|video_pad|>" in with_ids
    # an assistant turn after the last user query always carries a think block, empty or not
    last = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  hello  "}]
    assert render(name, last) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>\n"
    # images in assistant and tool turns are rendered (Qwen3-VL's template drops them)
    media = [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image"}]}]
    assert "<|image_pad|>" in render(name, media)


def test_preserve_thinking_is_qwen3_6_only():
    kept = render("qwen3.6", CONVERSATION, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nlooking\n</think>\n\nA cat.<|im_end|>" in kept
    assert "looking" not in render("qwen3.5", CONVERSATION, preserve_thinking=True)


def test_tools_system_prompt():
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    text = render("qwen3.5", CONVERSATION[:2], tools=tools)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           + json.dumps(tools[0]) + "\n</tools>\n\nIf you choose to call a function ONLY reply")
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\n" in text


@pytest.mark.parametrize("messages, error", [
    ([{"role": "tool", "content": "x"}], "No user query found in messages."),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], "System message must be at the beginning."),
    ([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "a"}],
     "System message cannot contain images."),
    ([{"role": "user", "content": [{"type": "audio"}]}], "Unexpected item type in content."),
])
def test_template_refusals(messages, error):
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match=re.escape(error)):
        render("qwen3.5", messages)


# --- processor constants ----------------------------------------------------------------------

def test_processor_constants():
    pre, video = c35.PREPROCESSOR_CONFIG, c35.VIDEO_PREPROCESSOR_CONFIG
    # the published files are json.dumps(indent=4): these are their sizes
    assert len(json.dumps(pre, indent=4)) == 390 and len(json.dumps(video, indent=4)) == 385
    vision = c35.QWEN3_5_VISION
    assert (vision.patch_size, vision.merge_size, vision.temporal_patch_size) == (16, 2, 2)
    assert (vision.min_pixels, vision.max_pixels) == (65536, 16777216) and vision.resize_factor == 32
    assert (c35.QWEN3_5_VIDEO.min_pixels, c35.QWEN3_5_VIDEO.max_pixels) == (4096, 25165824)
    assert c35.ROTARY_DIM == 64 and sum(c35.MROPE_SECTION) == c35.ROTARY_DIM // 2
    for name, token_id in c35.TOKEN_IDS.items():
        assert token_id in q35.ADDED_TOKEN_IDS.values(), name


def test_processor_classes_and_their_defaults():
    from transformers.models.auto import image_processing_auto, processing_auto, video_processing_auto
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    for model_type in ("qwen3_5", "qwen3_5_moe"):
        assert dict(processing_auto.PROCESSOR_MAPPING_NAMES)[model_type] == "Qwen3VLProcessor"
        assert "Qwen2VLImageProcessor" in str(dict(image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES)[model_type])
        assert "Qwen3VLVideoProcessor" in str(dict(video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES)[model_type])
    defaults = c35.QWEN3_5_VIDEO
    assert (Qwen3VLVideoProcessor.fps, Qwen3VLVideoProcessor.min_frames, Qwen3VLVideoProcessor.max_frames) == (
        defaults.fps, defaults.min_frames, defaults.max_frames)


# --- published config.json ---------------------------------------------------------------------

CONFIG_FILES = sorted(CONFIG_DIR.glob("*.json"))


def test_configs_are_the_published_bytes():
    rows = readme_rows(CONFIG_DIR / "README.md", "| file | checkpoint | revision |")
    assert [p.name for p in CONFIG_FILES] == sorted(rows)
    for path in CONFIG_FILES:
        data = path.read_bytes()
        _, checkpoint, revision, size, digest = rows[path.name]
        assert hashlib.sha256(data).hexdigest() == digest.strip("`") and len(data) == int(size), path.name
        assert json.dumps(json.loads(data), indent=4).encode() == data  # the published layout


def config_classes(spec):
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    if spec["model_type"] == "qwen3_5_moe":
        return Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    return Qwen3_5Config, Qwen3_5ForConditionalGeneration


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_fields_as_transformers_reads_them(path):
    spec = json.loads(path.read_text(encoding="utf-8"))
    config_cls, _ = config_classes(spec)
    config = config_cls.from_dict(spec)
    text = config.text_config
    assert text.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (text.num_hidden_layers // 4)
    assert text.full_attention_interval == 4 and text.linear_conv_kernel_dim == 4
    rope = text.rope_parameters
    assert rope["mrope_interleaved"] and list(rope["mrope_section"]) == list(c35.MROPE_SECTION)
    assert rope["partial_rotary_factor"] == c35.PARTIAL_ROTARY_FACTOR and rope["rope_theta"] == c35.ROPE_THETA
    assert text.head_dim == c35.HEAD_DIM and text.vocab_size == c35.VOCAB_SIZE == q35.EMBEDDING_ROWS
    assert text.mtp_num_hidden_layers == 1 and text.attn_output_gate
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id) == (
        c35.TOKEN_IDS["image_pad"], c35.TOKEN_IDS["video_pad"], c35.TOKEN_IDS["vision_start"], c35.TOKEN_IDS["vision_end"])
    vision = config.vision_config
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (16, 2, 2)
    assert vision.out_hidden_size == text.hidden_size and vision.num_position_embeddings == 48 * 48
    if spec["model_type"] == "qwen3_5_moe":
        assert text.shared_expert_intermediate_size == text.moe_intermediate_size


def shrunk(spec):
    """The published config with small sizes and every other field (token ids, vocabulary, rope,
    layer pattern, gates, mtp) as published."""
    spec = copy.deepcopy(spec)
    text, vision = spec["text_config"], spec["vision_config"]
    text.update(hidden_size=64, intermediate_size=96, num_hidden_layers=4, layer_types=text["layer_types"][:4],
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    text["rope_parameters"]["mrope_section"] = [2, 1, 1]  # 32 * 0.25 / 2 = 4 frequencies
    if "num_experts" in text:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    vision.update(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return spec


@pytest.mark.parametrize("name", ["Qwen3.5-0.8B", "Qwen3.5-35B-A3B"])  # dense with tied embeddings; MoE
def test_shrunken_model_trains_on_an_image(name):
    import torch

    path = CONFIG_DIR / f"{name}.json"

    spec = shrunk(json.loads(path.read_text(encoding="utf-8")))
    config_cls, model_cls = config_classes(spec)
    torch.manual_seed(0)
    model = model_cls(config_cls.from_dict(spec)).float()
    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 image tokens
    pixels = torch.randn(16, 3 * 2 * 16 * 16)
    ids = [c35.TOKEN_IDS["im_start"], 872, 198, c35.TOKEN_IDS["vision_start"], *[c35.TOKEN_IDS["image_pad"]] * 4,
           c35.TOKEN_IDS["vision_end"], 3838, 374, 419, 30, c35.TOKEN_IDS["im_end"]]
    input_ids = torch.tensor([ids])
    mm_types = (input_ids == c35.TOKEN_IDS["image_pad"]).long()
    out = model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm_types,
                labels=input_ids, use_cache=False)
    assert out.logits.shape == (1, len(ids), c35.VOCAB_SIZE) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    assert {type(layer.linear_attn).__name__ for layer in model.model.language_model.layers if
            hasattr(layer, "linear_attn")} and len(model.model.language_model.layers) == 4


def parameter_counts(spec):
    import torch

    config_cls, model_cls = config_classes(spec)
    config = config_cls.from_dict(spec)
    with torch.device("meta"):
        model = model_cls(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    text = config.text_config
    active = total - experts + experts * text.num_experts_per_tok // text.num_experts if experts else total
    return total, active


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_parameter_counts_are_the_recorded_ones(path):
    row = readme_rows(CONFIG_DIR / "README.md", "| file | total | active |")[path.name]
    total, active = parameter_counts(json.loads(path.read_text(encoding="utf-8")))
    assert total == int(row[1].replace(",", ""))
    assert row[2] == "(dense)" if total == active else active == int(row[2].replace(",", ""))
