"""Row layouts users have (ShareGPT / LLaVA / LLaMA-Factory, ms-swift, TRL) against Hugging Face.

Those projects turn a placeholder row into model input by putting the vision tokens in place of
each `<image>` in the text and applying the chat template to string contents. That is the
oracle here: the official template (HF `apply_chat_template`) on the string messages with every
placeholder replaced by `<|vision_start|><|image_pad|><|vision_end|>`, HF's image processor on
the images and `get_rope_index` of a tiny model; vlmpack's sample of the row in the named
layout must equal it in ids, loss mask, positions and pixels, on randomized conversations of
both families. The layouts are written by the tests as those projects document them.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest

from preprocess.errors import RejectError
from preprocess.formats import detect_row_format, to_openai_row
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.pipeline import SampleOptions, process_row
from shards_schema import open_shards
from shards_schema.pixels import pixel_values_from_patches
from tests.helpers.hf_reference import hf_sample
from tests.helpers.images import encoded_image
from tests.helpers.models import TINY_MODELS
from tests.helpers.render import expected_mask_from_ids, expected_trained

VISION = "<|vision_start|><|image_pad|><|vision_end|>"
WORDS = "the a cat dog red blue sky runs why how many is on under left right image picture".split()
CONVERSATIONS = 16


def _text(rng: random.Random, lo: int = 2, hi: int = 12) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    return text + rng.choice(["", ".", "?", "\n", " \n"])


def placeholder_conversation(rng: random.Random):
    """(turns [(role, text with <image> placeholders)], number of images): 1-3 user/assistant
    rounds, an optional system turn, 0-3 images per user turn at any place in its text."""
    turns, images = [], 0
    if rng.random() < 0.4:
        turns.append(("system", _text(rng)))
    for _ in range(rng.randint(1, 3)):
        pieces = [_text(rng)]
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            pieces.insert(rng.randint(0, len(pieces)), rng.choice(["<image>", "<image>\n"]))
            images += 1
        turns.append(("user", "".join(pieces)))
        turns.append(("assistant", _text(rng, 3, 20)))
    return turns, images


def _media(rng, nprng, tmp_path, n: int, embedded_ok: bool):
    """n images as the row lists them (file paths, data URIs, HF Image features) and as HF gets them."""
    listed, hf_images = [], []
    for _ in range(n):
        data, hf_image = encoded_image(nprng)
        kind = rng.choice(["path", "uri", "feature"] if embedded_ok else ["path", "uri"])
        if kind == "path":
            name = f"img{len(list(tmp_path.iterdir()))}.bin"
            (tmp_path / name).write_bytes(data)
            listed.append(name)
        elif kind == "uri":
            listed.append("data:image/x;base64," + base64.b64encode(data).decode())
        else:
            listed.append({"bytes": data, "path": None})
        hf_images.append(hf_image)
    return listed, hf_images


def as_layout(layout: str, turns, images: list, rng: random.Random) -> dict:
    if layout == "sharegpt":
        names = {"user": rng.choice(["human", "user"]), "assistant": rng.choice(["gpt", "assistant"]), "system": "system"}
        row = {"conversations": [{"from": names[role], "value": text} for role, text in turns]}
        if turns[0][0] == "system" and rng.random() < 0.5:  # LLaMA-Factory's top-level system
            row = {"system": turns[0][1], "conversations": row["conversations"][1:]}
        if len(images) == 1 and rng.random() < 0.5:
            row["image"] = images[0]  # LLaVA's single image
        else:
            row["images"] = images
        return row
    return {"messages": [{"role": role, "content": text} for role, text in turns], "images": images}


@pytest.mark.parametrize("layout", ["sharegpt", "swift"])
@pytest.mark.parametrize("family", ["qwen3-vl", "qwen2.5-vl"])
def test_placeholder_rows_equal_hf_on_the_substituted_text(layout, family, builtin_profiles, hf_tokenizers,
                                                            official_template, hf_image_processors, tmp_path):
    profile, tokenizer, template = builtin_profiles[family], hf_tokenizers[family], official_template[family]
    model = TINY_MODELS[family]()
    rng, nprng = random.Random(f"{layout}-{family}"), np.random.default_rng(5)
    options = SampleOptions(media_root=str(tmp_path), max_seq_len=1 << 20)
    images_seen = 0
    for n in range(CONVERSATIONS):
        turns, count = placeholder_conversation(rng)
        listed, hf_images = _media(rng, nprng, tmp_path, count, embedded_ok=True)
        row = as_layout(layout, turns, listed, rng)
        assert detect_row_format(row) == layout or (layout == "swift" and not count and "images" in row)
        sample = process_row(to_openai_row(row, layout), sample_uid=f"r{n}", source="x", profile=profile, options=options)
        messages = [{"role": role, "content": text.replace("<image>", VISION)} for role, text in turns]
        ids, positions, pixel_values, grid = hf_sample(family, messages, None, hf_images, tokenizer, template,
                                                       hf_image_processors[family], model)
        assert sample.input_ids.tolist() == ids, f"conversation {n}: {turns}"
        np.testing.assert_array_equal(sample.loss_mask, expected_mask_from_ids(
            ids, expected_trained(messages, "all_assistant"), tokenizer))
        np.testing.assert_array_equal(sample.position_ids, positions)
        np.testing.assert_array_equal(sample.image_grid_thw, grid)
        if hf_images:
            v = profile.vision
            ours = pixel_values_from_patches(sample.pixel_patches, v.image_mean, v.image_std, v.patch_size,
                                             v.temporal_patch_size)
            assert np.array_equal(ours, pixel_values)
        images_seen += count
    assert images_seen >= 15


def test_function_calls_and_tool_outputs_become_the_templates_tool_turns(builtin_profiles):
    """LLaMA-Factory's function_call / observation and ms-swift's tool_call / tool_response give
    the same sample as the OpenAI row with assistant tool_calls and tool messages."""
    profile = builtin_profiles["qwen3-vl"]
    options = SampleOptions(max_seq_len=1 << 20)
    tools = [{"name": "search", "description": "web search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}}}]
    call = {"name": "search", "arguments": {"q": "cats"}}
    openai = {"messages": [
        {"role": "user", "content": "find cats"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "[\"a cat\"]"},
        {"role": "assistant", "content": "Found a cat."}],
        "tools": [{"type": "function", "function": tools[0]}]}
    sharegpt = {"tools": json.dumps(tools), "conversations": [
        {"from": "human", "value": "find cats"}, {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": "[\"a cat\"]"}, {"from": "gpt", "value": "Found a cat."}]}
    swift = {"tools": tools, "images": [], "messages": [
        {"role": "user", "content": "find cats"}, {"role": "tool_call", "content": json.dumps(call)},
        {"role": "tool_response", "content": "[\"a cat\"]"}, {"role": "assistant", "content": "Found a cat."}]}
    want = process_row(openai, sample_uid="x", source="x", profile=profile, options=options)
    for layout, row in (("sharegpt", sharegpt), ("swift", swift)):
        got = process_row(to_openai_row(row, layout), sample_uid="x", source="x", profile=profile, options=options)
        assert got.input_ids.tolist() == want.input_ids.tolist(), layout
        assert got.loss_mask.tolist() == want.loss_mask.tolist(), layout
    # ms-swift: a tool_call right after an assistant's text joins that turn
    joined = to_openai_row({"images": None, "videos": [], "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me look."},
        {"role": "tool_call", "content": json.dumps(call)}, {"role": "tool_call", "content": json.dumps(call)}]}, "swift")
    assert joined["messages"][1] == {"role": "assistant", "content": "Let me look.",
                                     "tool_calls": [{"type": "function", "function": call}] * 2}


BAD_ROWS = [
    ("sharegpt", {"conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}]},
     "placeholder_mismatch", "<image> placeholder number 1 has no image"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}], "images": ["a.png"]},
     "placeholder_mismatch", "0 <image> placeholder(s) but 1 image(s)"),
    # a null entry is named as such, not as a placeholder without an image in a list that holds one
    ("sharegpt", {"conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}], "images": [None]},
     "empty_source", "`images[0]` is null"),
    ("swift", {"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
               "images": [""]}, "empty_source", "`images[0]` is an empty string"),
    # an empty cell is no image: the placeholder is the one without it
    ("sharegpt", {"conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}], "image": ""},
     "placeholder_mismatch", "<image> placeholder number 1 has no image"),
    # both spellings naming different images: neither is dropped unseen
    ("sharegpt", {"conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}],
                  "images": ["a.png"], "image": "b.png"},
     "placeholder_mismatch", "both `images` and LLaVA's `image`, naming different images: keep one"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}], "image": 5},
     "bad_row", "`image` must be a list of media references, got int"),
    # an entry that is no media reference is named in the row's own terms
    ("sharegpt", {"conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}], "images": [5]},
     "bad_content", "`images[0]` is 5, a number: give each entry of `images` a path"),
    ("swift", {"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
               "images": ["a.png", {"path": 5}]}, "bad_content", "`images[1]` is an object ({'path': 5}) without bytes"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "<video>x"}, {"from": "gpt", "value": "y"}],
                  "video": {"bytes": None, "path": None}}, "bad_content", "`video` is an object"),
    ("swift", {"messages": [{"role": "user", "content": "<video>x"}, {"role": "assistant", "content": "y"}],
               "videos": [True]}, "bad_content", "`videos[0]` is True, a boolean"),
    ("sharegpt", {"conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}]},
     "unknown_role", "'narrator' is not one of human"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{not json"}]},
     "bad_tool_call", "must be JSON"),
    ("sharegpt", {"conversations": []}, "no_messages", "non-empty list"),
    ("swift", {"messages": [{"role": "user", "content": "<video>x"}, {"role": "assistant", "content": "y"}], "videos": []},
     "placeholder_mismatch", "<video> placeholder number 1 has no video"),
    ("swift", {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
                            {"role": "assistant", "content": "y"}], "images": []},
     "placeholder_mismatch", "image part number 1 has no image"),
    ("swift", {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
                            {"role": "assistant", "content": "y"}], "images": [None]},
     "empty_source", "`images[0]` is null"),
    ("swift", {"messages": [{"role": "bot", "content": "x"}], "images": []}, "unknown_role", "'bot' is not one of"),
    ("swift", {"messages": [{"role": "user", "content": "x"}], "images": [], "objects": {"bbox": [[1, 2, 3, 4]]}},
     "unsupported_field", "objects"),
    ("swift", {"messages": [{"role": "user", "content": "<audio>x"}, {"role": "assistant", "content": "y"}],
               "audios": ["a.wav"]}, "unsupported_field", "`audios`: Qwen vision-language models take no audio"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "<audio>x"}, {"from": "gpt", "value": "y"}],
                  "audio": "a.wav"}, "unsupported_field", "`audio`: Qwen vision-language models take no audio"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "x", "loss": True}, {"from": "gpt", "value": "y"}]},
     "bad_message", "conversations[0]: loss true on a turn that is not the assistant's"),
    ("openai", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                "audios": ["a.wav"]}, "unsupported_field", "`audios`: Qwen vision-language models take no audio"),
    # ms-swift rows read as OpenAI (an input whose first row holds no media is detected as OpenAI)
    ("openai", {"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
                "images": ["a.png"]}, "unsupported_field", "`images` beside `messages` is the ms-swift layout"),
    ("openai", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "loss": False}]},
     "unsupported_field", "messages[1].loss is ms-swift's key, which --input-format openai does not read"),
    ("swift", {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}],
               "images": ["a.png"]}, "bad_content", "messages[0].content must be a string or a list of parts, got int"),
    # the OpenAI layout's flags on a ShareGPT turn, and the turns of two layouts in one row
    *[("sharegpt", {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y", key: value}]},
       "unsupported_field", f"conversations[1].{key} is the OpenAI layout's key") for key, value in
      (("train", False), ("weight", 0))],
    *[(layout, {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}],
                "messages": [{"role": "user", "content": "x"}]}, "bad_row",
       "the row holds both `messages` and `conversations`") for layout in ("sharegpt", "openai")],
    # a top-level system: the OpenAI layout has none; ms-swift's beside a system message of its own
    ("openai", {"system": "S", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "unsupported_field", "`system` beside `messages` is not read in the OpenAI layout: make it the first message"),
    ("swift", {"system": "S", "messages": [{"role": "system", "content": "T"}, {"role": "user", "content": "x"}],
               "images": []}, "bad_row", "both a top-level `system` and a system message, messages[0]"),
    ("swift", {"system": ["S"], "messages": [{"role": "user", "content": "x"}], "images": []},
     "bad_content", "`system` must be a string, got list"),
    ("sharegpt", {"system": "<image>S", "conversations": [{"from": "human", "value": "x"}], "images": ["a.png"]},
     "placeholder_mismatch", "`system` holds a <image> placeholder, which is read only in the conversation's turns"),
]


def test_an_ms_swift_rows_top_level_system_is_its_first_message():
    """As ms-swift reads it; a reject of the converted row names the row's own messages[k]."""
    from preprocess.formats import in_row_terms

    row = {"system": "S", "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
           "images": ["a.png"]}
    messages = to_openai_row(row, "swift")["messages"]
    assert messages[0] == {"role": "system", "content": "S"} and [m["role"] for m in messages] == [
        "system", "user", "assistant"]
    exc = in_row_terms(RejectError("bad_content", "messages[0].content and messages[2].content"), row, "swift")
    assert exc.message == "`system` and messages[1].content"
    assert in_row_terms(exc, {**row, "system": None}, "swift") is exc


def test_an_empty_media_cell_is_a_row_without_media():
    row = {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}], "image": "", "video": ""}
    assert to_openai_row(row, "sharegpt")["messages"][0] == {"role": "user", "content": "x"}


def test_a_sharegpt_turns_loss_is_its_train_flag():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "loss": False},
                             {"from": "human", "value": "q"}, {"from": "gpt", "value": "b", "loss": None},
                             {"from": "function_call", "value": '{"name": "f"}', "loss": True}]}
    messages = to_openai_row(row, "sharegpt")["messages"]
    assert [m.get("train") for m in messages] == [None, False, None, None, True]


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-vl-thinking", "qwen3-vl"])
def test_a_sharegpt_turns_reasoning_is_trained_where_the_template_renders_it(name):
    """A gpt turn's reasoning_content gives the OpenAI row's sample on a Thinking template and is
    rejected as dropped on an Instruct one; `thinking` / `reasoning`, which no template renders,
    reject the row rather than vanish."""
    from preprocess.profiles import builtin_profile

    profile, options = builtin_profile(name), SampleOptions(max_seq_len=1 << 20)
    openai = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "reasoning_content": "add two", "content": "4"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "2+2?"},
                                  {"from": "gpt", "value": "4", "reasoning_content": "add two"}]}
    if name == "qwen3-vl":
        for row in (openai, to_openai_row(sharegpt, "sharegpt")):
            with pytest.raises(RejectError) as err:
                process_row(row, sample_uid="x", source="x", profile=profile, options=options)
            assert err.value.code == "dropped_by_template", err.value
        return
    want = process_row(openai, sample_uid="x", source="x", profile=profile, options=options)
    got = process_row(to_openai_row(sharegpt, "sharegpt"), sample_uid="x", source="x", profile=profile, options=options)
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.loss_mask.tolist() == want.loss_mask.tolist()
    assert "add two" in profile.tokenizer.decode(got.input_ids[got.loss_mask.astype(bool)].tolist())
    for key in ("thinking", "reasoning"):
        turns = [sharegpt["conversations"][0], {"from": "gpt", "value": "4", key: "add two"}]
        with pytest.raises(RejectError) as err:
            process_row(to_openai_row({"conversations": turns}, "sharegpt"), sample_uid="x", source="x",
                        profile=profile, options=options)
        assert err.value.code == "dropped_by_template", err.value
        assert f"{key} would be dropped" in err.value.message and \
            err.value.message.endswith(": rename it to reasoning_content"), err.value.message


def test_a_sharegpt_rows_rejects_name_its_turns_as_conversations_k(tmp_path):
    """A reject found once the row is converted names the turn as the ShareGPT row does,
    conversations[k] (its top-level `system` is no turn of the list), not as the OpenAI row
    it became."""
    from preprocess.formats import in_row_terms

    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo", "thinking": "hmm"}]},
            {"system": "S", "conversations": [{"from": "human", "value": "Hi"}, {"from": "system", "value": "late"},
                                              {"from": "gpt", "value": "Yo"}]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "rows.jsonl")], out=str(tmp_path / "out"), workers=1,
                                    progress=False, input_format="sharegpt"))
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"].split(":")[0] for r in rejects] == ["conversations[1]", "conversations[1]"], rejects
    exc = in_row_terms(RejectError("bad_content", "messages[0].content and messages[3].content[1]"), rows[1],
                       "sharegpt")
    assert exc.code == "bad_content" and exc.message == "`system` and conversations[2].value[1]"
    openai = RejectError("bad_content", "message 1: x")
    assert in_row_terms(openai, {"messages": []}, "openai") is openai


@pytest.mark.parametrize("layout, row, code, detail", BAD_ROWS, ids=[f"{b[0]}-{b[2]}-{k}" for k, b in enumerate(BAD_ROWS)])
def test_bad_rows_are_rejected_with_a_named_code(layout, row, code, detail):
    with pytest.raises(RejectError) as err:
        to_openai_row(row, layout)
    assert err.value.code == code and detail in err.value.message


def test_a_videos_entry_may_be_its_frames():
    row = {"messages": [{"role": "user", "content": "<video>x"}, {"role": "assistant", "content": "y"}],
           "videos": [["f0.png", "f1.png"]]}
    assert to_openai_row(row, "swift")["messages"][0]["content"][0] == {"type": "video", "video": ["f0.png", "f1.png"]}


def _image_bytes(seed: int) -> bytes:
    return encoded_image(np.random.default_rng(seed))[0]


def test_each_input_is_detected_or_named_and_a_job_keeps_going(tmp_path):
    """JSONL in ShareGPT, JSON in ms-swift, Parquet with a conversations column and a `datasets`
    directory in the TRL layout (Image features) in one job; a missing image and a placeholder
    mismatch are rejected by name, every other row written; --input-format overrides detection."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(_image_bytes(1))
    turn = [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "A thing."}]
    (tmp_path / "llava.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "ok", "image": "a.png", "conversations": turn},
        {"id": "missing", "image": "nope.png", "conversations": turn},
        {"id": "mismatch", "images": ["a.png", "a.png"], "conversations": turn}]))
    (tmp_path / "swift.json").write_text(json.dumps([
        {"messages": [{"role": "user", "content": "<image><image>Differences?"}, {"role": "assistant", "content": "None."}],
         "images": ["a.png", "a.png"]}]))
    pq.write_table(pa.Table.from_pylist([{"conversations": turn, "images": ["a.png"]}] * 3), tmp_path / "sg.parquet")
    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        "images": datasets.Sequence(datasets.Image())})
    trl = datasets.Dataset.from_list([{
        "messages": [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Which?"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "This one."}]}],
        "images": [{"bytes": _image_bytes(k), "path": None}]} for k in range(4)], features=features)
    trl.save_to_disk(str(tmp_path / "trl"))
    inputs = [str(tmp_path / n) for n in ("llava.jsonl", "swift.json", "sg.parquet", "trl")]
    manifest = run_preprocess(PreprocessConfig(inputs=inputs, out=str(tmp_path / "out"), workers=1, progress=False,
                                               sample=SampleOptions(media_root=str(tmp_path / "media"))))
    acc = manifest["accounting"]
    assert [i["row_format"] for i in acc["inputs"]] == ["sharegpt", "swift", "sharegpt", "swift"]
    assert acc["rows_read"] == 11 and acc["rows_written"] == 9
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["row"], r["code"]) for r in rejects) == [(1, "missing_file"), (2, "placeholder_mismatch")]
    shards = open_shards(tmp_path / "out")
    assert sum(int(shards[i]["image_grid_thw"].shape[0]) for i in range(len(shards))) == 1 + 2 + 3 + 4
    # named: the ShareGPT file read as OpenAI rows has no `messages`, so every row is rejected as such
    named = run_preprocess(PreprocessConfig(inputs=[inputs[0]], out=str(tmp_path / "named"), workers=1, progress=False,
                                            input_format="openai", sample=SampleOptions(media_root=str(tmp_path / "media"))))
    assert named["accounting"]["rejects_by_reason"] == {"no_messages": 3}


@pytest.mark.parametrize("first", [[{"role": "user", "content": "hi"}], ["conversations"], "conversations", 7, None])
@pytest.mark.parametrize("container", ["jsonl", "json"])
def test_a_first_row_that_is_no_object_is_rejected_alone_and_decides_no_layout(tmp_path, first, container):
    """The layout is read from an input's first row that is a JSON object: a first row of another
    kind (a list of turns, a list of names, a string) is one `bad_row` reject, and the rows after
    it are read in their own layout and written."""
    turns = [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]
    rows = [first, {"id": "a", "conversations": turns}, {"id": "b", "conversations": turns}]
    path = tmp_path / f"rows.{container}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if container == "jsonl" else json.dumps(rows))
    manifest = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "out"), workers=1,
                                               progress=False))
    acc = manifest["accounting"]
    assert acc["inputs"][0]["row_format"] == "sharegpt"
    assert (acc["rows_read"], acc["rows_written"], acc["rejects_by_reason"]) == (3, 2, {"bad_row": 1})


@pytest.mark.parametrize("first", [{"conversations": None}, {"conversations": []}, {"messages": ""}, {"id": "x"},
                                   {"messages": None, "images": ["a.png"]}])
def test_a_first_object_without_turns_is_rejected_alone_and_decides_no_layout(tmp_path, first):
    """A first row that is an object but holds no turns (its chat null, empty or missing)
    cannot say the input's layout: the first row that holds turns does, so that row alone is
    rejected and the OpenAI rows after it are written."""
    turns = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [first, *({"id": k, "messages": turns} for k in "abc")]))
    manifest = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "out"), workers=1,
                                               progress=False))
    acc = manifest["accounting"]
    assert "row_format" not in acc["inputs"][0]  # recorded for the other layouts only
    assert (acc["rows_read"], acc["rows_written"], acc["rows_rejected"]) == (4, 3, 1)


def test_hub_dataset_by_name_with_split_config_and_image_features(tmp_path, monkeypatch, capsys):
    """`hf://datasets/ORG/NAME?config=...&split=...` goes through `datasets.load_dataset`, the
    same path as a Hub repository; here the repository (Parquet data files per config and
    split, declared in its README as on the Hub) is written to disk by the test and found
    there, offline. Its `Image` features are read as embedded bytes, and the samples equal the
    same rows given as a JSONL file with the images as files."""
    import datasets

    monkeypatch.chdir(tmp_path)
    repo = tmp_path / "acme" / "charts"
    (repo / "qa").mkdir(parents=True)
    (tmp_path / "media").mkdir()
    features = datasets.Features({
        "id": datasets.Value("string"),
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        "images": datasets.Sequence(datasets.Image())})
    rows, jsonl_rows = {"train": [], "test": []}, []
    for k in range(10):
        split = "test" if k % 3 == 0 else "train"
        data = _image_bytes(100 + k)
        messages = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": f"Chart {k}?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": f"It shows {k}."}]}]
        rows[split].append({"id": f"c{k}", "messages": messages, "images": [{"bytes": data, "path": None}]})
        if split == "test":
            (tmp_path / "media" / f"c{k}.png").write_bytes(data)
            jsonl_rows.append({"id": f"c{k}", "messages": messages, "images": [f"c{k}.png"]})
    for split, split_rows in rows.items():
        datasets.Dataset.from_list(split_rows, features=features).to_parquet(str(repo / "qa" / f"{split}.parquet"))
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: qa\n  data_files:\n  - split: train\n"
                                    "    path: qa/train.parquet\n  - split: test\n    path: qa/test.parquet\n---\n")
    spec = "hf://datasets/acme/charts?config=qa&split=test"
    manifest = run_preprocess(PreprocessConfig(inputs=[spec], out="hub", workers=1, progress=False))
    assert manifest["accounting"]["inputs"][0]["path"] == spec
    assert manifest["accounting"]["inputs"][0]["row_format"] == "swift"
    assert manifest["accounting"]["rows_written"] == len(rows["test"]) == 4
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in jsonl_rows))
    run_preprocess(PreprocessConfig(inputs=["rows.jsonl"], out="local", workers=1, progress=False,
                                    sample=SampleOptions(media_root=str(tmp_path / "media"))))
    hub, local = open_shards(tmp_path / "hub"), open_shards(tmp_path / "local")
    for i in range(4):
        for key in ("input_ids", "loss_mask", "position_ids", "pixel_patches", "image_grid_thw"):
            assert np.array_equal(hub[i][key], local[i][key]), key
    # a split that is not there: one line naming the input, exit 2
    from shards_schema.cli import main

    capsys.readouterr()
    code = main(["preprocess", "hf://datasets/acme/charts?config=qa&split=validation", "--out", "bad", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "split=validation" in err and "validation" in err.split(":", 2)[-1], err


# ---------------------------------------------------------------- inputs read as they stream, damaged inputs


def _random_json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:  # strings holding what a splitter could mistake for structure
        return "".join(rng.choice(['a"b', "x\\", "[{,}]", '\\"', "é漢😀", "", "\n\t", ",]", " ", "\\\\"])
                       for _ in range(rng.randint(0, 4)))
    if kind == 1:
        return rng.choice([0, -7, 3.25, 1e300, 10**30, True, False, None])
    if kind == 2:
        return rng.choice(["", "]", "[", "}", "{", ","])
    if kind == 3:
        return "w" * rng.randint(0, 30)
    if kind in (4, 5):
        return {rng.choice(["a", "b,", "c]", 'd"']) + str(k): _random_json_value(rng, depth + 1)
                for k in range(rng.randint(0, 3))}
    return [_random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def test_json_arrays_split_while_they_stream_give_the_rows_json_parses(tmp_path, monkeypatch):
    """A .json input is split into its top-level elements as it is read in blocks (7 bytes here,
    so strings, escapes and nesting cross block edges everywhere), never parsed whole: every
    unit's rows equal json.loads of the whole file, for random arrays whose strings hold quotes,
    brackets, commas, backslashes and non-ASCII text, with or without indentation, ASCII
    escapes, a byte order mark and whitespace around the array."""
    from preprocess import inputs

    monkeypatch.setattr(inputs, "READ_BLOCK_BYTES", 7)
    rng = random.Random(3)
    path = tmp_path / "rows.json"
    for _ in range(40):
        rows = [{"id": str(k), "v": _random_json_value(rng)} for k in range(rng.randint(0, 12))]
        text = json.dumps(rows, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5)
        head = rng.choice(["", "\ufeff", " \n"])
        path.write_bytes((head + text + rng.choice(["", "\n", "  \r\n"])).encode("utf-8"))
        per_unit = rng.randint(1, 5)
        inp = inputs.describe_input(str(path), per_unit)
        assert inp.num_rows == len(rows)
        got = [(index, row) for unit in inputs.plan_units([inp], per_unit)
               for index, row in inputs.read_rows(unit, per_unit)]
        assert got == list(enumerate(rows))


JSON_ARRAYS = [  # (file bytes, rows: a value, or (reject code, words of its reason))
    (b"[]", []),
    (b" \n[ \n]\n", []),
    (b'[{"a": "x]"}, {"b": "\\"],"}]', [{"a": "x]"}, {"b": '"],'}]),
    (b'[{"a": 1},]', [{"a": 1}, ("bad_json", "empty array element")]),
    (b'[{"a": 1},, 2]', [{"a": 1}, ("bad_json", "empty array element"), 2]),
    (b'[{"a": 1} xx, {"b": 2}]', [("bad_json", "not valid JSON"), {"b": 2}]),
    (b'[{"a": 1}, {"b": "\xff"}]', [{"a": 1}, ("bad_json", "is not UTF-8 text: byte 8 (0xff), invalid start byte")]),
    (b'[{"a": 1}, {"b": [1, 2', [{"a": 1}, ("bad_json", "the file is truncated")]),
    (b'[{"a": 1}, {"b": 2}', [{"a": 1}, ("bad_json", "the file is truncated")]),
    (b"[" + b"[" * 5000 + b"]" * 5000 + b", 7]", [("bad_json", "nested deeper than the JSON parser allows"), 7]),
    (b'[{"n": ' + b"9" * 5000 + b"}, 7]", [("bad_json", "an integer of more than 4300 digits"), 7]),
    (b'[{"n": NaN, "m": -Infinity}]', [{"n": float("nan"), "m": float("-inf")}]),  # what json reads; the row decides
    # a bracket left open inside an element closes with the element's own: the rows after it are found
    (b'[{"a": [1, 2}, {"b": 2}]', [("bad_json", "not valid JSON"), {"b": 2}]),
    (b'[{"a": {"b": [1}}, 3, {"c": [{"d": 1]}]', [("bad_json", "not valid JSON"), 3, ("bad_json", "not valid JSON")]),
    (b'[{"a": 1}, {"b": [1, 2}', [{"a": 1}, ("bad_json", "the file is truncated")]),
    # brackets are matched in constant time each: 200,000 deep splits in a moment
    (b'[{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}, 7]", [("bad_json", "nested deeper"), 7]),
    (b'[{"a": ' + b"[" * 200_000 + b"}, 7]", [("bad_json", "nested deeper"), 7]),
]


@pytest.mark.parametrize("data, expected", JSON_ARRAYS, ids=[str(k) for k in range(len(JSON_ARRAYS))])
def test_damaged_json_arrays_reject_the_damaged_element_and_keep_the_others(data, expected, tmp_path):
    from preprocess.inputs import describe_input, plan_units, read_rows

    path = tmp_path / "rows.json"
    path.write_bytes(data)
    inp = describe_input(str(path), 2)
    got = [row for unit in plan_units([inp], 2) for _, row in read_rows(unit, 2)]
    assert len(got) == len(expected) == inp.num_rows
    for row, want in zip(got, expected):
        if isinstance(want, tuple):
            assert isinstance(row, RejectError) and row.code == want[0] and want[1] in row.message, row
        else:
            assert json.dumps(row) == json.dumps(want)  # NaN compares equal only as text


def _parquet_bytes(rows: list[dict], row_group_size: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer, row_group_size=row_group_size)
    return buffer.getvalue()


def _chat(text: str, answer: str = "Fine.", **extra) -> dict:
    return {**extra, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]}


def test_damaged_rows_of_every_input_format_are_rejected_by_code_and_the_other_rows_kept(tmp_path):
    """One job over a damaged input of each format, with --max-row-bytes 256 KiB: JSONL lines that
    are not UTF-8, hold NUL bytes, are not an object, nest 100,000 deep, hold a 5000-digit
    integer or are over the limit, and a last line cut short; a JSON array with the same and a
    truncated end; a Parquet file with an unreadable middle row group (its rows rejected with
    the row range named) and a row over the limit; a `datasets` directory with a byte of an Arrow string buffer damaged. Each damaged row is rejected with
    its code at its row, every other row is written, and rows read = written + rejected."""
    import datasets
    import pyarrow.parquet as pq

    big = "x" * (300 << 10)
    good = [json.dumps(_chat(f"Hi {k}"), ensure_ascii=False).encode() for k in range(3)]
    jsonl = [
        (good[0], None),
        (b'{"messages": "\xff\xfe"}', "bad_json"),
        (b'{"mess\x00ages": []}', "bad_json"),
        (b"\x00\x00\x00", "bad_json"),
        (b"[1, 2]", "bad_row"),
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "bad_json"),
        (b'{"id": ' + b"9" * 5000 + b', "messages": []}', "bad_json"),
        (json.dumps(_chat(big)).encode(), "row_too_large"),
        (good[1], None),
        (good[2][:-5], "bad_json"),  # the last line, cut short
    ]
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(line for line, _ in jsonl))
    json_rows = [(good[0], None), (b'{"messages": "\xff"}', "bad_json"), (b"[" * 3000 + b"]" * 3000, "bad_json"),
                 (json.dumps(_chat(big)).encode(), "row_too_large"), (good[1], None), (good[2][:-9], "bad_json")]
    (tmp_path / "rows.json").write_bytes(b"[" + b",\n".join(row for row, _ in json_rows))  # no closing ]
    table_rows = [_chat(f"Row {k}") for k in range(30)]
    table_rows[25] = _chat(big)
    data = bytearray(_parquet_bytes(table_rows, row_group_size=10))
    group = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(1)
    data[group.column(0).data_page_offset] ^= 0xFF  # the first page header of row group 1
    (tmp_path / "table.parquet").write_bytes(bytes(data))
    ds_rows = [_chat("DAMAGED-ROW" if k == 2 else f"Saved {k}") for k in range(5)]
    datasets.Dataset.from_list(ds_rows).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes().replace(b"DAMAGED-ROW", b"\xff" * 11))

    inputs = ["rows.jsonl", "rows.json", "table.parquet", "saved"]
    manifest = run_preprocess(PreprocessConfig(inputs=[str(tmp_path / name) for name in inputs], out=str(tmp_path / "out"),
                                               workers=1, progress=False, rows_per_shard=4,
                                               sample=SampleOptions(max_row_bytes=256 << 10)))
    expected = {("rows.jsonl", k): code for k, (_, code) in enumerate(jsonl) if code}
    expected |= {("rows.json", k): code for k, (_, code) in enumerate(json_rows) if code}
    expected |= {("table.parquet", k): "unreadable_row" for k in range(10, 20)} | {("table.parquet", 25): "row_too_large"}
    expected |= {("saved", 2): "unreadable_row"}
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert {(Path(r["source"]).name, r["row"]): r["code"] for r in rejects} == expected
    unreadable = next(r["reason"] for r in rejects if r["code"] == "unreadable_row" and r["source"].endswith("parquet"))
    assert "Parquet row group 1 (rows 10-19) cannot be read" in unreadable
    acc = manifest["accounting"]
    assert acc["rows_read"] == len(jsonl) + len(json_rows) + 30 + 5 == acc["rows_written"] + acc["rows_rejected"]
    assert acc["rows_written"] == 2 + 2 + 19 + 4
    shards = open_shards(tmp_path / "out")
    assert sorted(shards[i]["source"].split(":")[-1] for i in range(len(shards))
                  if shards[i]["source"].startswith(str(tmp_path / "table.parquet"))) == sorted(
        str(k) for k in [*range(10), *range(20, 25), *range(26, 30)])


@pytest.mark.parametrize("lines", [3, 520])  # 520 lines of 126 bytes + CRLF: a CRLF straddles the 64 KiB probe
def test_crlf_jsonl_is_read_at_its_lf_and_a_raw_cr_rejects_only_its_row(tmp_path, lines):
    """Windows line breaks split as LF ones; a raw CR inside one row's string (JSON refuses it
    there) makes that row bad JSON and keeps the input and its other rows."""
    rows = [json.dumps(_chat(f"Hi {k}".ljust(60, "x"))).encode().ljust(126) for k in range(lines)]
    (tmp_path / "crlf.jsonl").write_bytes(b"".join(row + b"\r\n" for row in rows))
    (tmp_path / "raw-cr.jsonl").write_bytes(b'\n'.join([rows[0], b'{"messages": "a\rb"}', rows[1]]) + b"\n")
    manifest = run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "crlf.jsonl"), str(tmp_path / "raw-cr.jsonl")],
                                               out=str(tmp_path / "out"), workers=1, progress=False))
    acc = manifest["accounting"]
    assert (acc["rows_read"], acc["rows_written"]) == (lines + 3, lines + 2)
    assert acc["rejects_by_reason"] == {"bad_json": 1}


def test_a_long_first_row_is_read_past_64_kib_before_its_line_breaks_are_judged(tmp_path):
    """A CRLF input whose first row is 64 KiB long, and an LF one whose long first row holds a raw
    CR, are read (the raw CR rejects its row alone), not refused as CR line breaks."""
    long_row = json.dumps(_chat("x" * 70_000)).encode()
    (tmp_path / "crlf.jsonl").write_bytes(b"".join(row + b"\r\n" for row in [long_row, *[json.dumps(
        _chat(w)).encode() for w in "ab"]]))
    raw_cr = long_row.replace(b"xxxx", b"x\rxx", 1)
    (tmp_path / "raw-cr.jsonl").write_bytes(raw_cr + b"\n" + json.dumps(_chat("c")).encode() + b"\n")
    manifest = run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "crlf.jsonl"), str(tmp_path / "raw-cr.jsonl")],
                                               out=str(tmp_path / "out"), workers=1, progress=False))
    acc = manifest["accounting"]
    assert (acc["rows_read"], acc["rows_written"], acc["rejects_by_reason"]) == (5, 4, {"bad_json": 1})


def test_a_jsonl_whose_first_row_is_an_array_rejects_that_row_alone(tmp_path):
    """A whole JSON array on the first line is one bad row, not a misnamed .json file."""
    lines = [json.dumps([1, 2]), *(json.dumps(_chat(w)) for w in "ab")]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    acc = run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "rows.jsonl")], out=str(tmp_path / "out"), workers=1,
                                          progress=False))["accounting"]
    assert (acc["rows_read"], acc["rows_written"], acc["rejects_by_reason"]) == (3, 2, {"bad_row": 1})


def test_a_compressed_name_says_how_to_unpack_it():
    from preprocess.inputs import _compressed_name

    assert "unpack it first (`gunzip -k rows.jsonl.gz`)" in _compressed_name("rows.jsonl.gz")
    assert "unpack it first (`tar -xzf rows.tar.gz`)" in _compressed_name("rows.tar.gz")
    assert "download and unpack it and give" in _compressed_name("s3://bucket/rows.jsonl.zst")
    assert _compressed_name("rows.jsonl") is None


def test_ms_swift_rows_with_a_top_level_system_are_detected_as_ms_swift():
    """Its top-level system is what the OpenAI layout has not: auto reads such an input as
    ms-swift's, whose system is the first message, not as OpenAI's, which refuses it."""
    row = {"system": "S", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    assert detect_row_format(row) == "swift" and detect_row_format(["system", "messages"]) == "swift"
    assert detect_row_format({**row, "system": None}) == "openai"
    assert to_openai_row(row, detect_row_format(row))["messages"][0] == {"role": "system", "content": "S"}


def _damaged_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (an input that cannot be opened at all, words its one-line error must hold)."""
    import datasets

    good = _parquet_bytes([_chat("Hi")] * 3, 10)
    files = {
        "json-object.json": (b'{"messages": []}', "must be an array of rows"),
        "json-empty.json": (b" \n", "empty, not a JSON array"),
        "json-two-arrays.json": (b"[1] [2]", "more data after the JSON array ends (at byte 4)"),
        # UTF-16 / UTF-32 text: its line breaks are not b"\n" bytes, its rows would be cut apart
        "utf16.jsonl": ("\n".join(json.dumps(_chat(w)) for w in "abc").encode("utf-16"),
                        "is UTF-16 text (it starts with a UTF-16 byte order mark), but JSON and JSONL inputs are read as "
                        "UTF-8: convert it, e.g. `iconv -f UTF-16 -t UTF-8"),
        "utf32.jsonl": (json.dumps(_chat("a")).encode("utf-32"), "is UTF-32 text"),
        "utf16-be.json": (b"\xfe\xff" + ("[" + json.dumps(_chat("a")) + "]").encode("utf-16-be"), "is UTF-16 text"),
        "cr-lines.jsonl": ("\r".join(json.dumps(_chat(w)) for w in "abc").encode(),
                           "ends its lines in CR alone (classic Mac OS line breaks), but JSONL rows are split at LF: "
                           "convert it, e.g. `tr '\\r' '\\n' <"),
        # a string or bracket left open with the array's `]` at the end: the rows after it cannot be told apart
        "json-open-string.json": (b'[{"a": 1}, {"b": "x}, {"c": 2}]\n', "the array element at byte 10 (element 1) "
                                  "leaves a string or a bracket open"),
        "json-open-object.json": (b'[{"a": [1]\n, {"b": 2}]', "leaves a string or a bracket open"),
        # compressed, or one JSON array under a JSONL name: rows of garbage
        "gzip.jsonl": (gzip.compress(json.dumps(_chat("a")).encode() + b"\n"),
                       "is gzip-compressed, but JSON and JSONL inputs are read as plain UTF-8 text: unpack it first, "
                       "e.g. `gunzip -c"),
        "zstd.json": (b"\x28\xb5\x2f\xfd" + bytes(20), "is zstd-compressed"),
        "rows.jsonl.gz": (gzip.compress(b"{}"), "is a compressed file (.gz), but inputs are read uncompressed: unpack "
                          "it first (`gunzip -k"),
        "array.jsonl": (json.dumps([_chat(w) for w in "ab"]).encode(), "holds one JSON array (it starts with `[`), "
                        "not JSON lines (one row object per line): name it .json"),
        "array-indented.jsonl": (json.dumps([_chat(w) for w in "ab"], indent=2).encode(), "holds one JSON array"),
        "array-lines.jsonl": (("[" + ",\n".join(json.dumps(_chat(w)) for w in "abc") + "]\n").encode(),
                              "holds one JSON array"),
        "parquet-truncated.parquet": (good[: len(good) // 2], "not a readable Parquet file"),
        "parquet-footer.parquet": (good[:-4] + b"XXXX", "not a readable Parquet file"),
        "parquet-empty.parquet": (b"", "not a readable Parquet file"),
    }
    cases = {}
    for name, (data, words) in files.items():
        (tmp_path / name).write_bytes(data)
        cases[name] = (tmp_path / name, words)
    for name, damage, words in [
        ("ds-no-arrow", lambda d: next(d.glob("*.arrow")).unlink(), "No such file or directory"),
        ("ds-state", lambda d: (d / "state.json").write_text("{broken"), "state.json"),
        ("ds-info", lambda d: (d / "dataset_info.json").write_text("[1,"), "dataset_info.json"),
        ("ds-truncated-arrow", lambda d: (lambda f: f.write_bytes(f.read_bytes()[:100]))(next(d.glob("*.arrow"))),
         "cannot be loaded"),
    ]:
        directory = tmp_path / name
        datasets.Dataset.from_list([_chat("Hi")] * 3).save_to_disk(str(directory))
        damage(directory)
        cases[name] = (directory, words)
    return cases


def test_an_input_that_cannot_be_opened_at_all_stops_the_job_with_one_line(tmp_path, capsys):
    """A JSON file that is not one array (an object, empty, two arrays) or whose element leaves a
    string or bracket open before its `]`, a JSON or JSONL file in UTF-16 or UTF-32 (its byte
    order mark) or compressed (by its bytes or its name), one JSON array named .jsonl, a JSONL
    file of CR line breaks, a truncated or empty
    Parquet file or one with a damaged footer, a `datasets` directory with its Arrow file missing
    or truncated or its state.json / dataset_info.json damaged: exit 2 before the job starts,
    one line naming the input, what is wrong and the fix; no output directory is made."""
    from tests.helpers.cli import vlmpack_exit_code

    for name, (path, words) in _damaged_inputs(tmp_path).items():
        out = tmp_path / f"out-{name}"
        capsys.readouterr()
        code = vlmpack_exit_code(["preprocess", str(path), "--out", str(out), "--workers", "1", "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and str(path) in err and words in err, (name, err)
        assert "Traceback" not in err and not out.exists(), name
