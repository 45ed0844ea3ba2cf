"""Qwen3-VL Thinking data: assistant reasoning (`reasoning_content`, or a `<think>` block in the
content) rendered exactly as the official Thinking template renders it (`tests/fixtures/`,
provenance beside it), on randomized conversations, with the reasoning a target or not as
`--reasoning-loss` says; what the template would drop is rejected, never lost silently."""

from __future__ import annotations

import json
import random

import pytest

from preprocess.errors import RejectError
from preprocess.families import family_named
from preprocess.profiles import builtin_profile
from preprocess.render import IM_END, render_conversation
from tests.conftest import THINKING_TEMPLATE_FILE
from tests.helpers.render import expected_trained, rand_conversation

CONVERSATIONS = 300
REASONING = ["Let me think.", "\nStep 1: look.\nStep 2: count.\n", "", "hmm, 3 + 4 = 7", "  spaced  "]


@pytest.fixture(scope="module")
def thinking_template() -> str:
    return THINKING_TEMPLATE_FILE.read_text(encoding="utf-8")


def thinking_conversation(rng: random.Random):
    """A random conversation with reasoning on some assistant turns, as `reasoning_content` or as
    a `<think>` block leading the content. Video parts use the `video` spelling the template renders."""
    messages, tools, _ = rand_conversation(rng, "qwen3-vl")
    for m in messages:
        if isinstance(m.get("content"), list):
            m["content"] = [{"type": "video", "video": "v.mp4"} if "video_url" in p else p for p in m["content"]]
        if m["role"] == "assistant" and rng.random() < 0.6:
            reasoning = rng.choice(REASONING)
            if rng.random() < 0.5 and isinstance(m.get("content"), str):
                m["content"] = f"<think>{reasoning}</think>" + rng.choice(["", "\n", "\n\n"]) + m["content"]
            else:
                m["reasoning_content"] = reasoning
    return messages, tools


def expected_targets(text: str, reasoning_loss: str, trained: list[bool]) -> str:
    """The target text of an all-assistant loss, read off the template's own output: each
    trained assistant turn (`trained`, in order, from the rows' `train` flags) after its header (after `<think>\\n` where the turn opens a think block,
    after `</think>\\n\\n` when the reasoning is masked) through its `<|im_end|>`."""
    out, at, turn = [], 0, 0
    header = "<|im_start|>assistant\n"
    while (start := text.find(header, at)) >= 0:
        body_start = start + len(header)
        end = text.index(IM_END, body_start) + len(IM_END)
        body = text[body_start:end]
        if body.startswith("<think>\n"):
            body = body[len("<think>\n"):] if reasoning_loss == "train" else body.split("\n</think>\n\n", 1)[1]
        if trained[turn]:
            out.append(body)
        at, turn = end, turn + 1
    return "".join(out)


@pytest.mark.parametrize("reasoning_loss", ["train", "mask"])
def test_rows_equal_the_official_thinking_template(reasoning_loss, hf_tokenizers, thinking_template):
    tokenizer = hf_tokenizers["qwen3-vl"]
    rng = random.Random(f"thinking-{reasoning_loss}")
    matched = think_turns = dropped = 0
    for n in range(CONVERSATIONS):
        messages, tools = thinking_conversation(rng)
        want = tokenizer.apply_chat_template(messages, tools=tools, chat_template=thinking_template, tokenize=False)
        try:
            ours = render_conversation(messages, family=family_named("qwen3-vl"), tools=tools, template="thinking",
                                       reasoning_loss=reasoning_loss)
        except RejectError as exc:
            assert exc.code in ("dropped_by_template", "no_targets"), f"conversation {n}: {exc}"
            if "drops the reasoning" in exc.message:  # the template's text is the same without that reasoning
                index = int(exc.message.split("message ")[1].split(":")[0])
                without = json.loads(json.dumps(messages))
                if "reasoning_content" in without[index]:
                    without[index]["reasoning_content"] = ""
                else:  # the template reads list content as its texts joined
                    content = without[index]["content"]
                    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
                    without[index]["content"] = text.split("</think>")[-1].lstrip("\n")
                assert want == tokenizer.apply_chat_template(without, tools=tools, chat_template=thinking_template,
                                                             tokenize=False), f"conversation {n}"
                dropped += 1
            continue
        assert ours.text == want, f"conversation {n}"
        targets = "".join(ours.text[s:e] for s, e in ours.target_spans)
        assert targets == expected_targets(want, reasoning_loss, expected_trained(messages, "all_assistant")), \
            f"conversation {n}"
        matched += 1
        think_turns += want.count("<|im_start|>assistant\n<think>\n")
    assert matched >= 100 and think_turns >= 100 and dropped >= 20, (matched, think_turns, dropped)


def test_add_vision_id_equals_the_official_thinking_template(hf_tokenizers, thinking_template):
    tokenizer = hf_tokenizers["qwen3-vl"]
    rng = random.Random("thinking-vision-id")
    numbered = 0
    for n in range(CONVERSATIONS // 4):
        messages, tools = thinking_conversation(rng)
        try:
            ours = render_conversation(messages, family=family_named("qwen3-vl"), tools=tools, template="thinking",
                                       add_vision_id=True)
        except RejectError:
            continue
        want = tokenizer.apply_chat_template(messages, tools=tools, chat_template=thinking_template, tokenize=False,
                                             add_vision_id=True)
        assert ours.text == want, f"conversation {n}"
        numbered += "Picture 2: " in want or "Video 2: " in want
    assert numbered >= 3, numbered


def test_instruct_profile_still_rejects_reasoning_and_thinking_profile_names_its_template():
    rows = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}]
    with pytest.raises(RejectError, match="Instruct templates do not render reasoning"):
        render_conversation(rows, family=family_named("qwen3-vl"))
    profile = builtin_profile("qwen3-vl-thinking")
    assert (profile.family, profile.template) == ("qwen3-vl", "thinking")
    assert profile.fingerprint["chat_template_sha256"] == "36e042fe45641f067b1f2381fcc8955d10d956a3ed333ecdf7f7eb0916f68956"
    assert profile.fingerprint["id"] != builtin_profile("qwen3-vl").fingerprint["id"]
    text = render_conversation(rows, family=family_named("qwen3-vl"), template="thinking").text
    assert text.endswith("<|im_start|>assistant\n<think>\n2+2=4\n</think>\n\n4<|im_end|>\n")


def test_a_model_directory_with_the_thinking_template_is_detected_and_checked(tmp_path, thinking_template):
    from preprocess.profiles import profile_from_model_dir

    base = builtin_profile("qwen3-vl")
    v = base.vision
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    (tmp_path / "tokenizer.json").write_text(base.tokenizer_json, encoding="utf-8")
    (tmp_path / "chat_template.jinja").write_text(thinking_template, encoding="utf-8")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": v.patch_size, "merge_size": v.merge_size, "temporal_patch_size": v.temporal_patch_size,
        "image_mean": list(v.image_mean), "image_std": list(v.image_std),
        "size": {"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels}}))
    profile = profile_from_model_dir(tmp_path)  # runs every template probe through HF and the renderer
    assert profile.template == "thinking" and profile.fingerprint["name"] == "qwen3-vl-thinking"
    # the same tokenizer, template, vision and video settings: shards interchangeable with the built-in profile's
    assert profile.fingerprint["id"] == builtin_profile("qwen3-vl-thinking").fingerprint["id"]


def test_a_thinking_job_reports_the_profile_it_was_asked_for(tmp_path, capsys):
    """The Thinking profile shares its family's rendering rules; the manifest, the job's summary
    and inspect (text, JSON and the HTML report) still name the profile that was asked for."""
    from shards_schema.cli import main
    from shards_schema.inspect import inspect_shards

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}, {
        "role": "assistant", "content": "4", "reasoning_content": "2+2=4"}]}) + "\n")
    out = tmp_path / "out"
    assert main(["preprocess", str(data), "--out", str(out), "--profile", "qwen3-vl-thinking", "--workers", "1",
                 "--no-progress"]) == 0
    assert "\nprofile:        qwen3-vl-thinking (fingerprint " in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["profile"]["name"] == "qwen3-vl-thinking"
    assert main(["inspect", str(out), "--plots", str(tmp_path / "plots")]) == 0
    assert "\nprofile          qwen3-vl-thinking  fingerprint " in capsys.readouterr().out
    assert inspect_shards(out)["profile"]["name"] == "qwen3-vl-thinking"
    assert "<td>qwen3-vl-thinking (fingerprint " in (tmp_path / "plots" / "report.html").read_text()


def test_a_thinking_job_writes_verified_shards(tmp_path):
    from preprocess.job import PreprocessConfig, run_preprocess
    from preprocess.pipeline import SampleOptions
    from shards_schema import open_shards, verify_shards

    rows = [{"id": f"t{k}", "messages": [
        {"role": "user", "content": f"What is {k} + {k}?"},
        {"role": "assistant", "content": f"{2 * k}", "reasoning_content": f"{k} plus {k} makes {2 * k}."}]}
        for k in range(6)]
    rows.append({"id": "history", "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "lost"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {}
    for loss in ("train", "mask"):
        manifest = run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / loss), profile="qwen3-vl-thinking",
                                                   workers=1, progress=False, sample=SampleOptions(reasoning_loss=loss)))
        assert manifest["accounting"]["rows_written"] == 6 and manifest["accounting"]["rejects_by_reason"] == {
            "dropped_by_template": 1}
        assert verify_shards(tmp_path / loss).ok
        out[loss] = open_shards(tmp_path / loss)
    profile = builtin_profile("qwen3-vl-thinking")
    for k in range(6):
        trained = {loss: profile.tokenizer.decode(out[loss][k]["input_ids"][1:][out[loss][k]["loss_mask"][1:] > 0].tolist(),
                                                  skip_special_tokens=False) for loss in out}
        assert trained["train"] == f"{k} plus {k} makes {2 * k}.\n</think>\n\n{2 * k}<|im_end|>"
        assert trained["mask"] == f"{2 * k}<|im_end|>"
