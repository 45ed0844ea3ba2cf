"""The Qwen3.5 / Qwen3.6 family on the data side against its oracles: the official templates as
Hugging Face renders them (text byte for byte, the generation prompt as the context ahead of
each trained turn, thinking on and off), HF's own processor (`Qwen3VLProcessor`, which
transformers gives `qwen3_5` checkpoints, over the built-in profile's tokenizer, the published
processor constants and the official template) and a tiny Qwen3.5's `get_rope_index`, on seeded
random conversations with images, videos, tool calls, reasoning and several turns; the
registries and `--model DIR`; `verify` on Qwen3.5 shards; preprocessing then two training
steps of `--arch tiny-qwen3.5` on CPU.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from preprocess.errors import RejectError
from preprocess.families import BUILTIN_PROFILES, MODEL_TYPE_FAMILY, family_named
from preprocess.render import render_conversation, tokenize_rendered

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TEMPLATE_FILES = {"qwen3.5": FIXTURES / "qwen3_5.chat_template.jinja",
                  "qwen3.6": FIXTURES / "qwen3_6.chat_template.jinja"}
PROFILES = tuple(TEMPLATE_FILES)
# Qwen3.5-0.8B's and -2B's template: thinking off unless asked (tests/fixtures/README.md)
SMALL_TEMPLATE = FIXTURES / "qwen3_5_small.chat_template.jinja"
SMALL_TEMPLATE_SHA256 = "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80"
CASES = 40  # random conversations per rendering test


@pytest.fixture(scope="module")
def profiles():
    from preprocess.profiles import builtin_profile

    return {name: builtin_profile(name) for name in PROFILES}


def hf_render(profile_name: str, messages: list, tools=None, template: Path | None = None, **kwargs) -> str:
    """transformers' rendering of the profile's official template (or of the `template` file)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    text = (template or TEMPLATE_FILES[profile_name]).read_text(encoding="utf-8")
    out = render_jinja_template(conversations=[messages], tools=tools, chat_template=text, **kwargs)
    return out[0][0]


# --- random conversations ------------------------------------------------------------------------

WORDS = ["Hello", "你好，世界", "👋🏽", "e\u0301", "שלום", "x = 1\nprint(x)", "  ", "\n", "\n\n", " the answer ",
         "<tool_call>", "</tool_response>", "42", "...", "\t"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.choice([0, 1, 2, 3])))


def _visual(rng: random.Random, n: int) -> dict:
    if rng.random() < 0.25:
        return {"type": "video", "video": f"clips/{n}.mp4"}
    return rng.choice([{"type": "image", "image": f"images/{n}.png"},
                       {"type": "image_url", "image_url": {"url": f"https://example.com/{n}.png"}}])


def _content(rng: random.Random, visuals: bool):
    if not visuals or rng.random() < 0.4:
        return _text(rng) or "hi"
    parts = [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(0, 2))]
    parts += [_visual(rng, rng.randrange(10**6)) for _ in range(rng.randint(1, 2))]
    rng.shuffle(parts)
    return parts


def _arguments(rng: random.Random) -> dict:
    values = ["Paris", "multi\nline", 3, 0.5, True, False, None, [1, "a"], {"k": [True, None]}, "", "東京"]
    return {f"p{k}": rng.choice(values) for k in range(rng.randint(0, 3))}


def _assistant(rng: random.Random, tools: bool, visuals: bool) -> dict:
    message = {"role": "assistant", "content": _text(rng) or "ok"}
    roll = rng.random()
    if roll < 0.3:
        message["reasoning_content"] = rng.choice(["", "Let me think.", "\nstep 1\nstep 2\n", " 思考 "])
    elif roll < 0.5:
        reasoning = rng.choice(["", "hmm", "a\nb"])
        message["content"] = "<think>\n" + reasoning + "\n</think>\n\n" + (_text(rng) or "done")
    if visuals and rng.random() < 0.2:
        message["content"] = [{"type": "text", "text": message["content"]}] if "reasoning_content" in message or \
            "</think>" not in message["content"] else message["content"]
        if isinstance(message["content"], list):
            message["content"].append(_visual(rng, rng.randrange(10**6)))
    if tools and rng.random() < 0.5:
        message["tool_calls"] = [
            rng.choice([{"type": "function", "function": {"name": f"fn{k}", "arguments": _arguments(rng)}},
                        {"name": f"fn{k}", "arguments": _arguments(rng)}])
            for k in range(rng.randint(1, 2))]
        if rng.random() < 0.3:
            message["content"] = rng.choice(["", None])
    return message


def rand_conversation(rng: random.Random, visuals: bool = True, early_reasoning: bool = False) -> tuple[list, list | None]:
    """A conversation every part of which the templates render: system (text), tools, user turns
    with images and videos, assistant turns with reasoning (field or <think> block), images and
    tool calls, tool results with images; reasoning only after the last user query, unless
    `early_reasoning` (for `preserve_thinking`, which renders it in every turn)."""
    tools = None
    if rng.random() < 0.4:
        tools = [{"type": "function", "function": {"name": f"fn{k}", "description": _text(rng),
                                                   "parameters": {"type": "object", "properties": {}}}}
                 for k in range(rng.randint(1, 2))]
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice([_text(rng), [{"type": "text", "text": _text(rng)}]])})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _content(rng, visuals)})
        for _ in range(rng.randint(1, 2)):
            message = _assistant(rng, tools is not None, visuals)
            messages.append(message)
            if message.get("tool_calls"):
                for _ in message["tool_calls"]:
                    messages.append({"role": "tool", "content": _content(rng, visuals)})
                messages.append({"role": "assistant", "content": _text(rng) or "so"})
    if early_reasoning:
        return messages, tools
    # the templates drop the reasoning of turns before the last user query: keep it only after
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for i, m in enumerate(messages[:last_user]):
        if m["role"] == "assistant":
            m.pop("reasoning_content", None)
            if isinstance(m["content"], str) and "</think>" in m["content"]:
                m["content"] = m["content"].split("</think>")[-1]
    return messages, tools


def hf_messages(messages: list) -> list:
    """What HF's template is given: content None as absent (as `render_conversation` reads it)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


# --- the renderer against the official templates ----------------------------------------------------


@pytest.mark.parametrize("name", PROFILES)
def test_rendered_text_equals_the_official_template(name, profiles):
    family = profiles[name].family_rules
    rng = random.Random(f"render-{name}")
    seen = {"tool_calls": 0, "reasoning": 0, "visual_in_assistant": 0, "video": 0, "multi_turn": 0, "tools": 0}
    for n in range(CASES):
        messages, tools = rand_conversation(rng)
        ours = render_conversation(messages, family=family, tools=tools, template=profiles[name].template)
        assert ours.text == hf_render(name, hf_messages(messages), tools), n
        seen["tool_calls"] += any(m.get("tool_calls") for m in messages)
        seen["reasoning"] += any(m.get("reasoning_content") or "</think>" in str(m.get("content")) for m in messages)
        seen["visual_in_assistant"] += any(m["role"] == "assistant" and isinstance(m["content"], list) for m in messages)
        seen["video"] += "<|video_pad|>" in ours.text
        seen["multi_turn"] += sum(m["role"] == "user" for m in messages) > 1
        seen["tools"] += tools is not None
    assert min(seen.values()) >= 2, seen


def test_the_two_templates_differ_in_how_they_write_arguments(profiles):
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "f", "arguments": '{"on": true, "none": null, "n": 2, "s": "x"}'}}]}]
    texts = {name: render_conversation(messages, family=profiles[name].family_rules,
                                       template=profiles[name].template).text for name in PROFILES}
    assert "<parameter=on>\nTrue\n</parameter>\n<parameter=none>\nNone\n" in texts["qwen3.5"]
    assert "<parameter=on>\ntrue\n</parameter>\n<parameter=none>\nnull\n" in texts["qwen3.6"]
    parsed = [{**messages[1], "tool_calls": [{"function": {"name": "f", "arguments": json.loads(
        messages[1]["tool_calls"][0]["function"]["arguments"])}}]}]
    for name in PROFILES:  # a JSON string renders as its object does
        assert texts[name] == hf_render(name, [messages[0], *parsed])


def _last_turn_prompt(name: str, messages: list, tools, thinking: bool) -> str:
    return hf_render(name, hf_messages(messages[:-1]), tools, add_generation_prompt=True, enable_thinking=thinking)


@pytest.mark.parametrize("name", PROFILES)
def test_targets_start_where_the_generation_prompt_ends(name, profiles):
    """The last assistant turn's context is exactly the generation prompt: with thinking on
    (`<think>\\n`) when it has reasoning, off (`<think>\\n\\n</think>\\n\\n`) when it has none;
    its reasoning (`reasoning_loss=train`), content, tool calls and `<|im_end|>` are the targets."""
    profile = profiles[name]
    rng = random.Random(f"prompt-{name}")
    seen = {True: 0, False: 0}
    for n in range(CASES):
        messages, tools = rand_conversation(rng)
        last = messages[-1]
        if last["role"] != "assistant" or any(p.get("type") != "text" for p in last["content"]
                                              if isinstance(last["content"], list)):
            continue
        for loss in ("train", "mask"):
            rendered = render_conversation(messages, family=profile.family_rules, tools=tools, template=profile.template,
                                           loss_policy="last_assistant", reasoning_loss=loss)
            text = rendered.text
            thinking = "<think>\n\n</think>\n\n" not in text[text.rindex("<|im_start|>assistant\n"):]
            prompt = _last_turn_prompt(name, messages, tools, thinking)
            start, end = rendered.target_spans[0] if len(rendered.target_spans) == 1 else (None, None)
            if thinking and loss == "mask":  # the reasoning and its </think> are context too
                assert text[len(prompt):rendered.target_spans[0][0]].endswith("\n</think>\n\n"), n
            else:
                assert (start, end) == (len(prompt), len(text) - 1), (n, rendered.target_spans, len(prompt))
            assert text.startswith(prompt) and text.endswith("<|im_end|>\n"), n
        seen[thinking] += 1
    assert min(seen.values()) >= 2, seen


def test_reasoning_before_the_last_query_and_rows_the_template_refuses_are_rejected(profiles):
    family = profiles["qwen3.5"].family_rules
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "why"},
               {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    cases = {
        "dropped_by_template": [
            history,
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x<think>r</think>y"}],
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>r</think>y</think>z"}]],
        "bad_message": [[{"role": "user", "content": "a"}, {"role": "system", "content": "late"},
                         {"role": "assistant", "content": "b"}],
                        [{"role": "tool", "content": "r"}, {"role": "user", "content": "a"},
                         {"role": "assistant", "content": "b"}],
                        [{"role": "user", "content": "<tool_response>r</tool_response>"},
                         {"role": "assistant", "content": "b"}]],
        "bad_content": [[{"role": "system", "content": [{"type": "image", "image": "a.png"}]},
                         {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]],
        "bad_tool_call": [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "",
                                                               "tool_calls": [{"name": "f", "arguments": "[1]"}]}],
                          # a key given twice: the template writes one <parameter> per key, the other value lost
                          [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
                              {"name": "f", "arguments": '{"a": 1, "b": {"c": 2, "c": 3}}'}]}]],
    }
    for code, rows in cases.items():
        for messages in rows:
            with pytest.raises(RejectError) as error:
                render_conversation(messages, family=family, template="qwen3.5")
            assert error.value.code == code, messages
    # what is dropped really is: the official template's text lacks it
    assert "why" not in hf_render("qwen3.5", history)
    assert "x" not in hf_render("qwen3.5", cases["dropped_by_template"][1][:2]).split("assistant\n")[-1]
    # what is refused raises in the official template
    for messages in cases["bad_message"] + cases["bad_content"]:
        if messages[0]["role"] != "tool":
            with pytest.raises(Exception):
                hf_render("qwen3.5", messages)


@pytest.mark.parametrize("name", PROFILES)
def test_add_vision_id_numbers_pictures_and_videos_as_the_template_does(name, profiles):
    """`add_vision_id` (`--add-vision-id`): `Picture n: ` / `Video n: ` before each image and
    video, numbered through the conversation, as context; the text equals the template's."""
    family = profiles[name].family_rules
    rng = random.Random(f"vision-id-{name}")
    numbered = 0
    for n in range(CASES // 2):
        messages, tools = rand_conversation(rng)
        ours = render_conversation(messages, family=family, tools=tools, template=name, add_vision_id=True)
        assert ours.text == hf_render(name, hf_messages(messages), tools, add_vision_id=True), n
        plain = render_conversation(messages, family=family, tools=tools, template=name)
        ids = ours.text.count("Picture ") - plain.text.count("Picture ")
        assert ids == len(ours.image_sources) and len(ours.image_sources) == len(plain.image_sources), n
        trained = "".join(ours.text[a:b] for a, b in ours.target_spans)
        assert trained == "".join(plain.text[a:b] for a, b in plain.target_spans), n  # the numbers are context
        numbered += ids > 1
    assert numbered >= 2


def test_preserve_thinking_keeps_every_turns_reasoning_as_the_qwen3_6_template_does(profiles):
    """`preserve_thinking` (`--preserve-thinking`, Qwen3.6's template only): reasoning before the
    last user query renders as the template writes it and trains as the last turn's does (or is
    context, `reasoning_loss=mask`); the Qwen3.5 template has no such variable: refused."""
    family = profiles["qwen3.6"].family_rules
    rng = random.Random("preserve-thinking")
    early = 0
    for n in range(CASES):
        messages, tools = rand_conversation(rng, early_reasoning=True)
        hf_text = hf_render("qwen3.6", hf_messages(messages), tools, preserve_thinking=True)
        for loss in ("train", "mask"):
            ours = render_conversation(messages, family=family, tools=tools, template="qwen3.6",
                                       reasoning_loss=loss, preserve_thinking=True)
            assert ours.text == hf_text, n
            trained = "".join(ours.text[a:b] for a, b in ours.target_spans)
            for m in messages[:max(i for i, m in enumerate(messages) if m["role"] == "user")]:
                reasoning = (m.get("reasoning_content") or "").strip() if m["role"] == "assistant" else ""
                if reasoning:
                    early += loss == "train"
                    assert (reasoning + "\n</think>\n\n" in trained) == (loss == "train"), (n, reasoning)
    assert early >= 5
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "why"},
               {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    kept = render_conversation(history, family=family, template="qwen3.6", preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nwhy\n</think>\n\nb<|im_end|>" in kept.text
    with pytest.raises(RejectError) as error:  # without it the row would lose "why"
        render_conversation(history, family=family, template="qwen3.6")
    assert error.value.code == "dropped_by_template" and "--preserve-thinking" in str(error.value)
    with pytest.raises(ValueError, match="qwen3.5 template has no preserve_thinking.*--profile qwen3.6"):
        render_conversation(history, family=family, template="qwen3.5", preserve_thinking=True)
    for other in ("qwen3-vl", "qwen2.5-vl"):
        with pytest.raises(ValueError, match="no preserve_thinking"):
            render_conversation(history[-2:], family=family_named(other), preserve_thinking=True)


# --- whole rows against HF's processor and get_rope_index ----------------------------------------


@pytest.fixture(scope="module")
def hf_processor(profiles, tmp_path_factory):
    """HF's `Qwen3VLProcessor` (what transformers maps `qwen3_5` to) over the built-in profile's
    tokenizer, the published image and video processor constants and the official template; a
    tiny Qwen3.5 for `get_rope_index`."""
    from transformers import AutoTokenizer, Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from preprocess.families.qwen3_5_constants import PREPROCESSOR_CONFIG as IMG, VIDEO_PREPROCESSOR_CONFIG as VID
    from tests.helpers.models import tiny_qwen3_5

    directory = tmp_path_factory.mktemp("qwen3_5-tokenizer")
    (directory / "tokenizer.json").write_text(profiles["qwen3.5"].tokenizer_json, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    images = Qwen2VLImageProcessorPil(size=IMG["size"], **{k: IMG[k] for k in keys})
    videos = Qwen3VLVideoProcessor(size=VID["size"], **{k: VID[k] for k in keys})
    processors = {name: Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos,
                                         chat_template=TEMPLATE_FILES[name].read_text(encoding="utf-8"))
                  for name in PROFILES}
    return processors, tiny_qwen3_5()


def _media_row(rng: random.Random, nprng, media, messages):
    """Give every image and video part of `messages` a real file; returns HF's images, videos and
    video metadata in order of appearance."""
    from transformers.video_utils import load_video

    from preprocess.examples import synthetic_image, synthetic_video_frames, write_video

    images, videos, meta = [], [], []
    for message in messages:
        if not isinstance(message.get("content"), list):
            continue
        for part in message["content"]:
            if part.get("type") in ("image", "image_url"):
                img = synthetic_image(nprng, rng.randint(20, 300), rng.randint(20, 300))
                buf = io.BytesIO()
                img.save(buf, format="PNG")
                part.clear()
                part.update({"type": "image_url",
                             "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
                images.append(img)
            elif part.get("type") == "video":
                n, fps = rng.randint(2, 24), rng.choice([2.0, 8.0, 24.0])
                path = write_video(media / f"v{len(list(media.iterdir()))}.mp4",
                                   synthetic_video_frames(nprng, n, rng.randint(40, 120), rng.randint(40, 120)), fps)
                part["video"] = path.name
                # HF's own decode of every frame (MP4 records its frame count), sampled by its processor
                frames, metadata = load_video(str(path), backend="pyav",
                                              sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))
                videos.append(frames)
                meta.append(metadata)
    return images, videos, meta


@pytest.mark.parametrize("name", PROFILES)
def test_rows_equal_hf_processing(name, profiles, hf_processor, tmp_path):
    """Token ids, loss masks, pixel values and grids of images and videos, M-RoPE positions;
    Qwen3.6's rows with the template variables `add_vision_id` and `preserve_thinking` set (and
    reasoning in earlier turns), Qwen3.5's without."""
    import torch

    from preprocess.pipeline import SampleOptions, process_row
    from shards_schema.pixels import pixel_values_from_patches, video_pixel_values_from_patches

    profile = profiles[name]
    processors, model = hf_processor
    processor = processors[name]
    rng, nprng = random.Random(f"rows-{name}"), np.random.default_rng(3)
    media = tmp_path / "media"
    media.mkdir()
    variables = {"add_vision_id": name == "qwen3.6", "preserve_thinking": name == "qwen3.6"}
    options = SampleOptions(media_root=str(media), max_seq_len=1 << 20, **variables)
    seen = {"images": 0, "videos": 0, "text_only": 0}
    for n in range(3):
        messages, tools = rand_conversation(rng, visuals=n > 0, early_reasoning=variables["preserve_thinking"])
        if n == 1:  # a video (its timestamps) and an image in every run, however the draws fall
            user = next(m for m in messages if m["role"] == "user")
            user["content"] = [{"type": "video", "video": "v"}, {"type": "image", "image": "i"},
                               {"type": "text", "text": "What happens?"}]
        images, videos, meta = _media_row(rng, nprng, media, messages)
        sample = process_row({"messages": messages, "tools": tools}, sample_uid=f"r{n}", source="x", profile=profile,
                             options=options)
        text = processor.apply_chat_template(hf_messages(messages), tools=tools, tokenize=False, **variables)
        assert ("Picture 1: " in text) == (bool(images) and variables["add_vision_id"]), n
        hf = processor(text=[text], images=images or None, videos=videos or None, video_metadata=meta or None,
                       return_tensors="pt", cap_pixels_per_frame=False)
        ids = hf["input_ids"][0].numpy()
        assert sample.input_ids.tolist() == ids.tolist(), n
        # the targets are exactly the rendered text's target spans, and no vision token is one
        rendered = render_conversation(messages, family=profile.family_rules, tools=tools, template=profile.template,
                                       **variables)
        _, mask = tokenize_rendered(rendered, profile.tokenizer)
        targets = profile.tokenizer.decode(ids[sample.loss_mask == 1].tolist(), skip_special_tokens=False)
        expected = "".join(rendered.text[a:b] for a, b in rendered.target_spans)
        assert targets == unicodedata.normalize("NFC", expected), n  # the tokenizer normalizes to NFC
        assert int(sample.loss_mask.sum()) == int(mask.sum())
        assert not sample.loss_mask[hf["mm_token_type_ids"][0].numpy() > 0].any()
        if images:
            assert sample.image_grid_thw.tolist() == hf["image_grid_thw"].tolist()
            v = profile.vision
            ours = pixel_values_from_patches(sample.pixel_patches, v.image_mean, v.image_std, v.patch_size,
                                             v.temporal_patch_size)
            assert np.array_equal(ours, hf["pixel_values"].numpy()), n
        if videos:
            assert sample.video_grid_thw.tolist() == hf["video_grid_thw"].tolist()
            assert np.array_equal(video_pixel_values_from_patches(sample.video_patches, profile.video.image_mean,
                                                                  profile.video.image_std),
                                  hf["pixel_values_videos"].numpy()), n
        with torch.no_grad():
            positions, _ = model.model.get_rope_index(input_ids=hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"],
                                                      image_grid_thw=hf.get("image_grid_thw"),
                                                      video_grid_thw=hf.get("video_grid_thw"))
        assert np.array_equal(sample.position_ids, positions[:, 0].numpy()), n
        seen["images"] += len(images)
        seen["videos"] += len(videos)
        seen["text_only"] += not images and not videos
    assert min(seen.values()) >= 1, seen


# --- registries and --model DIR --------------------------------------------------------------------


def test_builtin_profiles_and_model_types():
    assert BUILTIN_PROFILES["qwen3.5"] == ("qwen3.5", "qwen3.5") and BUILTIN_PROFILES["qwen3.6"] == ("qwen3.5", "qwen3.6")
    assert MODEL_TYPE_FAMILY["qwen3_5"] == MODEL_TYPE_FAMILY["qwen3_5_moe"] == "qwen3.5"
    from shards_schema.builtin import builtin_chat_template

    for name in PROFILES:
        assert builtin_chat_template(name) == TEMPLATE_FILES[name].read_text(encoding="utf-8")


@pytest.mark.parametrize("name, model_type", [("qwen3.5", "qwen3_5"), ("qwen3.6", "qwen3_5_moe")])
def test_model_dir_of_a_qwen3_5_checkpoint_is_its_builtin_profile(name, model_type, profiles, tmp_path):
    from preprocess.families.qwen3_5_constants import PREPROCESSOR_CONFIG, VIDEO_PREPROCESSOR_CONFIG
    from preprocess.profiles import profile_from_model_dir

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "vision_config": {}}))
    (tmp_path / "tokenizer.json").write_text(profiles[name].tokenizer_json, encoding="utf-8")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG))
    shutil.copy(TEMPLATE_FILES[name], tmp_path / "chat_template.jinja")
    profile = profile_from_model_dir(tmp_path)
    assert (profile.family, profile.template, profile.name) == ("qwen3.5", name, name)
    assert profile.fingerprint["id"] == profiles[name].fingerprint["id"]


def test_the_template_check_tells_the_two_templates_apart(profiles):
    """`--model DIR` renders by the template's kind: a template of one release passes the check
    as its own kind and fails it as the other's (the probes hold arguments of every JSON type)."""
    from preprocess.errors import ConfigError
    from preprocess.render import check_template_matches

    for name, other in (("qwen3.5", "qwen3.6"), ("qwen3.6", "qwen3.5")):
        text = TEMPLATE_FILES[name].read_text(encoding="utf-8")
        check_template_matches(profiles[name], text)
        with pytest.raises(ConfigError, match="tool call arguments of every JSON type"):
            check_template_matches(profiles[other], text)


def test_a_template_that_drops_media_in_assistant_turns_is_refused(profiles):
    """Qwen3.5 renders an assistant turn's images and videos: a --model template edited to write
    only their text fails the check on the probe that holds them."""
    from preprocess.errors import ConfigError
    from preprocess.render import check_template_matches

    official = TEMPLATE_FILES["qwen3.5"].read_text(encoding="utf-8")
    line = "{%- set content = render_content(message.content, true)|trim %}"
    assert official.count(line) == 1
    text_only = ('{%- set content = (render_content(message.content, true) if message.role != "assistant" or '
                 'message.content is string else message.content|selectattr("type", "equalto", "text")'
                 '|map(attribute="text")|join(""))|trim %}')
    with pytest.raises(ConfigError, match="not one vlmpack renders natively: .* on probe 'media in an assistant turn'"):
        check_template_matches(profiles["qwen3.5"], official.replace(line, text_only))


def test_the_small_checkpoints_template_renders_training_rows_as_qwen3_5(profiles, tmp_path):
    """Qwen3.5-0.8B's and -2B's template differs from the larger checkpoints' only in its
    generation prompt (thinking off unless asked): training rows render the same, so a
    checkpoint directory holding it is the `qwen3.5` profile, and every rendered row equals
    that template's own rendering."""
    from preprocess.families.qwen3_5_constants import PREPROCESSOR_CONFIG, VIDEO_PREPROCESSOR_CONFIG
    from preprocess.profiles import profile_from_model_dir

    assert hashlib.sha256(SMALL_TEMPLATE.read_bytes()).hexdigest() == SMALL_TEMPLATE_SHA256
    prompt = [{"role": "user", "content": "hi"}]
    assert hf_render("qwen3.5", prompt, template=SMALL_TEMPLATE, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert hf_render("qwen3.5", prompt, add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "vision_config": {}}))
    (tmp_path / "tokenizer.json").write_text(profiles["qwen3.5"].tokenizer_json, encoding="utf-8")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG))
    shutil.copy(SMALL_TEMPLATE, tmp_path / "chat_template.jinja")
    profile = profile_from_model_dir(tmp_path)
    assert (profile.family, profile.template) == ("qwen3.5", "qwen3.5")
    rng = random.Random("small-template")
    for n in range(CASES // 2):
        messages, tools = rand_conversation(rng)
        ours = render_conversation(messages, family=profile.family_rules, tools=tools, template=profile.template)
        assert ours.text == hf_render("qwen3.5", hf_messages(messages), tools, template=SMALL_TEMPLATE), n


# --- verify and training --------------------------------------------------------------------------


def _preprocess(tmp: Path, rows: list) -> Path:
    from preprocess.examples import write_jsonl
    from shards_schema.cli import main as vlmpack

    data = write_jsonl(tmp / "chats.jsonl", rows)
    out = tmp / "shards"
    assert vlmpack(["preprocess", str(data), "--out", str(out), "--profile", "qwen3.5", "--workers", "1",
                    "--max-seq-len", "1024", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def qwen3_5_shards(tmp_path_factory) -> Path:
    from preprocess.examples import example_rows

    rows = example_rows(10, seed=4, family="qwen3.5", size_range=(32, 96), video_rows=0.5)
    rows.append({"id": "thinking", "messages": [{"role": "user", "content": "2+2?"},
                                                 {"role": "assistant", "reasoning_content": "4.", "content": "4"}]})
    return _preprocess(tmp_path_factory.mktemp("qwen3_5"), rows)


def test_preserve_thinking_preprocesses_multi_turn_reasoning_with_qwen3_6_and_is_refused_for_qwen3_5(tmp_path,
                                                                                                    capsys):
    """`--preserve-thinking`: a Qwen3.6 job keeps the rows whose earlier turns hold reasoning
    (rejected without it, never dropped silently) and verifies clean; a Qwen3.5 job is refused
    before any work, exit 2 and one line naming the flag and the fix."""
    from preprocess.examples import write_jsonl
    from shards_schema import open_shards
    from shards_schema.cli import main as vlmpack
    from shards_schema.verify import verify_shards

    rows = [{"id": f"r{k}", "messages": [
        {"role": "user", "content": f"{k}+1?"}, {"role": "assistant", "reasoning_content": "add one", "content": f"{k + 1}"},
        {"role": "user", "content": "and twice that?"},
        {"role": "assistant", "reasoning_content": "double it", "content": f"{2 * (k + 1)}"}]} for k in range(3)]
    rows.append({"id": "single", "messages": rows[0]["messages"][2:]})
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    common = [str(data), "--workers", "1", "--no-progress", "--add-vision-id"]
    assert vlmpack(["preprocess", *common, "--out", str(tmp_path / "plain"), "--profile", "qwen3.6"]) == 0
    manifest = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert manifest["accounting"]["rejects_by_reason"] == {"dropped_by_template": 3}, manifest["accounting"]
    assert manifest["settings"]["add_vision_id"] and not manifest["settings"]["preserve_thinking"]
    assert vlmpack(["preprocess", *common, "--out", str(tmp_path / "kept"), "--profile", "qwen3.6",
                    "--preserve-thinking"]) == 0
    assert verify_shards(tmp_path / "kept").fault_counts == {}
    shards = open_shards(tmp_path / "kept")
    assert len(shards) == 4
    from preprocess.profiles import builtin_profile

    sample = shards[0]
    trained = builtin_profile("qwen3.6").tokenizer.decode(sample["input_ids"][sample["loss_mask"] == 1].tolist(),
                                                          skip_special_tokens=False)
    assert "add one\n</think>" in trained and "double it\n</think>" in trained
    capsys.readouterr()
    assert vlmpack(["preprocess", *common, "--out", str(tmp_path / "refused"), "--profile", "qwen3.5",
                    "--preserve-thinking"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--preserve-thinking" in err and "--profile qwen3.6" in err, err
    assert not (tmp_path / "refused").exists()


def test_qwen3_5_shards_verify_clean_and_a_bad_timestamp_is_named(qwen3_5_shards, tmp_path):
    from preprocess.profiles import builtin_profile
    from shards_schema.verify import verify_shards
    from tests.helpers.shards import rewrite_shard

    manifest = json.loads((qwen3_5_shards / "manifest.json").read_text())
    assert manifest["profile"]["family"] == "qwen3.5" and manifest["totals"]["videos"] >= 2
    report = verify_shards(qwen3_5_shards)
    assert report.fault_counts == {}, report.format_text()

    broken = Path(shutil.copytree(qwen3_5_shards, tmp_path / "broken"))
    special = manifest["profile"]["special_tokens"]
    k = next(k for k, e in enumerate(manifest["shards"]) if e.get("videos", 1))
    tokenizer = builtin_profile("qwen3.5").tokenizer
    broken_row = []

    def break_a_timestamp(samples):
        row = next(j for j, s in enumerate(samples) if (s.input_ids == special["video_pad"]).any())
        ids = samples[row].input_ids
        start = int(np.flatnonzero(ids == special["video_pad"])[0])
        first = int(np.flatnonzero(ids[: start - 1] == special["vision_start"])[-1]) + 1  # the first group's timestamp
        assert tokenizer.decode(ids[first:start - 1].tolist()).startswith("<")
        ids[first] = tokenizer.token_to_id("x")  # "<" -> "x" (one token for one): the positions still hold
        broken_row.append(row)

    rewrite_shard(broken, k, break_a_timestamp)
    report = verify_shards(broken)
    assert set(report.fault_counts) == {"video_timestamps"}, report.format_text()
    assert "is not '<t.t seconds>'" in report.faults[0].message and report.faults[0].row == broken_row[0]


def test_preprocess_then_train_tiny_qwen3_5_two_steps(qwen3_5_shards, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    args = ["--arch", "tiny-qwen3.5", "--data", str(qwen3_5_shards), "--out", str(out), "--seq-len", "1024",
            "--global-batch-packs", "2", "--lr", "3e-3", "--warmup-steps", "1", "--num-workers", "0",
            "--tensorboard", "false", "--log-every", "1", "--train-steps", "2"]
    proc = subprocess.run([sys.executable, "-m", "train.trainer", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_example_rows_of_a_profile_are_its_familys():
    """The example rows of `--profile qwen3.6` are those of its family, tool calls included."""
    from preprocess.examples import example_rows

    rows = example_rows(30, seed=1, family="qwen3.6", size_range=(16, 32))
    assert rows == example_rows(30, seed=1, family="qwen3.5", size_range=(16, 32))
    assert any("tool_calls" in m for row in rows for m in row["messages"])
