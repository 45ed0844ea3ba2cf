"""`preprocess.render` against the oracle: Hugging Face's own jinja rendering of the official
chat templates (tests/fixtures) and HF's tokenizer, for both families, on randomized
conversations; loss masks against an id-level assistant-turn scan that never looks at
character offsets; every reject code; the `--model DIR` template check."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from preprocess.errors import ConfigError, RejectError
from preprocess.families import family_named
from preprocess.render import (
    IMAGE_PLACEHOLDER,
    REJECT_CODES,
    TEMPLATE_PROBES,
    check_template_matches,
    render_conversation,
    tokenize_rendered,
)
from tests.helpers.render import expected_mask_from_ids, expected_trained, hf_template_messages, rand_conversation

N_RANDOM = 300
POLICIES = ("all_assistant", "last_assistant")


# ---------------------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------------------


def hf_render(tokenizer, template: str, messages: list, tools, **variables) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False, **variables)
    ids = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=False,
                                        **variables)
    return text, list(ids)


def check_against_hf(family, messages, tools, sources, profile, hf_tokenizer, template, add_vision_id=False) -> int:
    """Compare text, ids and masks under every policy; returns how many policies left no targets."""
    text, ids = hf_render(hf_tokenizer, template, hf_template_messages(messages), tools, add_vision_id=add_vision_id)
    videos = [s[1] for s in sources if isinstance(s, tuple)]
    sources = [s for s in sources if not isinstance(s, tuple)]
    no_targets = 0
    for policy in POLICIES:
        trained = expected_trained(messages, policy)
        if not any(trained):
            with pytest.raises(RejectError) as err:
                render_conversation(messages, family=family_named(family), tools=tools, loss_policy=policy)
            assert err.value.code == "no_targets"
            no_targets += 1
            continue
        rendered = render_conversation(messages, family=family_named(family), tools=tools, loss_policy=policy,
                                       add_vision_id=add_vision_id)
        assert rendered.text == text
        assert rendered.image_sources == sources
        assert [v.source for v in rendered.videos] == videos
        input_ids, loss_mask = tokenize_rendered(rendered, profile.tokenizer)
        assert input_ids.dtype == np.int32 and loss_mask.dtype == np.uint8
        assert input_ids.tolist() == ids
        np.testing.assert_array_equal(loss_mask, expected_mask_from_ids(ids, trained, hf_tokenizer,
                                                                        text if add_vision_id else None))
        image_pads = input_ids == profile.special.image_pad
        assert image_pads.sum() == len(sources) and not loss_mask[image_pads].any()
        video_pads = input_ids == profile.special.video_pad
        assert video_pads.sum() == len(videos) and not loss_mask[video_pads].any()
    return no_targets


def test_random_conversations_match_hf(family, builtin_profiles, hf_tokenizers, official_template):
    rng = random.Random(f"render-{family}")
    stats = {"images": 0, "videos": 0, "tools": 0, "tool_msgs": 0, "no_targets": 0}
    for _ in range(N_RANDOM):
        messages, tools, sources = rand_conversation(rng, family)
        stats["images"] += len(sources)
        stats["videos"] += sum(isinstance(s, tuple) for s in sources)
        stats["tools"] += bool(tools)
        stats["tool_msgs"] += sum(m["role"] == "tool" for m in messages)
        stats["no_targets"] += check_against_hf(
            family, messages, tools, sources, builtin_profiles[family], hf_tokenizers[family], official_template[family]
        )
    # the generator really exercises the features
    assert stats["images"] > N_RANDOM and stats["tool_msgs"] > 20 and stats["no_targets"] > 5
    assert stats["videos"] > N_RANDOM // 10
    assert family == "qwen2.5-vl" or (stats["tools"] > 50 and stats["tool_msgs"] > 100)


def test_add_vision_id_matches_hf(family, builtin_profiles, hf_tokenizers, official_template):
    """The templates' `add_vision_id` (`--add-vision-id`): `Picture n: ` / `Video n: ` before
    each image and video, numbered through the conversation; ids and masks as HF's."""
    rng = random.Random(f"vision-id-{family}")
    numbered = 0
    for _ in range(N_RANDOM // 10):
        messages, tools, sources = rand_conversation(rng, family)
        check_against_hf(family, messages, tools, sources, builtin_profiles[family], hf_tokenizers[family],
                         official_template[family], add_vision_id=True)
        numbered += len(sources) > 1
    assert numbered >= 5


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3.6"])
def test_a_vision_label_merged_with_the_text_before_it_is_never_a_target(name):
    """In an assistant turn, `Picture n: ` may merge with the target text before it into one
    token (" Picture"): that token is context, as the label and the image are."""
    from preprocess.profiles import builtin_profile

    profile = builtin_profile(name)
    messages = [{"role": "user", "content": "show me"},
                {"role": "assistant", "content": [{"type": "text", "text": "Here it is "},
                                                  {"type": "image", "image": "a.png"},
                                                  {"type": "text", "text": " done"}]}]
    rendered = render_conversation(messages, family=profile.family_rules, template=profile.template, add_vision_id=True)
    ids, mask = tokenize_rendered(rendered, profile.tokenizer)
    tokens = [profile.tokenizer.id_to_token(int(i)) for i in ids]
    label = tokens.index("\u0120Picture")  # the byte-level BPE's space + "Picture": it starts in the target text
    assert mask[label] == 0 and mask[label - 1] == 1 and tokens[label - 1] == "\u0120is"
    assert profile.tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == "Here it is done<|im_end|>"


def media_sources_in_order(messages: list) -> list:
    """Each image's source, and ("video", source) for each video, in order (`check_against_hf`)."""
    sources = []
    for message in messages:
        if isinstance(message["content"], list):
            for part in message["content"]:
                if part.get("type") == "video":
                    sources.append(("video", part["video"]))
                    continue
                source = part.get("image_url", part.get("image", part.get("url", part.get("path"))))
                if source is not None:
                    sources.append(source["url"] if isinstance(source, dict) else source)
    return sources


def test_probes_match_hf(family, builtin_profiles, hf_tokenizers, official_template):
    """The template-check probes are hand-written edge cases; they must agree with HF too."""
    checked = 0
    for _, messages, tools in TEMPLATE_PROBES:
        try:
            render_conversation(messages, family=family_named(family), tools=tools)
        except RejectError:
            continue  # content this family rejects (covered by the reject tests)
        sources = media_sources_in_order(messages)
        check_against_hf(
            family, messages, tools, sources, builtin_profiles[family], hf_tokenizers[family], official_template[family]
        )
        checked += 1
    assert checked == {"qwen3-vl": 13, "qwen2.5-vl": 10}[family]  # the rest carry content the family rejects


# ---------------------------------------------------------------------------------------------
# Hand-written cases: exact masks and template subtleties
# ---------------------------------------------------------------------------------------------


def target_text(rendered):
    return [rendered.text[a:b] for a, b in rendered.target_spans]


def test_spans_cover_content_tool_calls_and_im_end_only():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "first", "train": False},
        {"role": "user", "content": "q2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}],
        },
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "last"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    rendered = render_conversation(messages, family=family_named("qwen3-vl"), tools=tools)
    assert target_text(rendered) == [
        '<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call><|im_end|>',
        "last<|im_end|>",
    ]
    last_only = render_conversation(messages, family=family_named("qwen3-vl"), tools=tools, loss_policy="last_assistant")
    assert target_text(last_only) == ["last<|im_end|>"]
    messages[1]["train"] = True  # forces it in under last_assistant
    forced = render_conversation(messages, family=family_named("qwen3-vl"), tools=tools, loss_policy="last_assistant")
    assert target_text(forced) == ["first<|im_end|>", "last<|im_end|>"]


def test_qwen2_5_assistant_images_are_cut_out_of_spans(builtin_profiles):
    messages = [
        {"role": "user", "content": "draw"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image", "image": "x.png"},
                {"type": "text", "text": "b"},
            ],
        },
    ]
    rendered = render_conversation(messages, family=family_named("qwen2.5-vl"))
    assert target_text(rendered) == ["a", "b<|im_end|>"]
    assert rendered.text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    ids, mask = tokenize_rendered(rendered, builtin_profiles["qwen2.5-vl"].tokenizer)
    assert (
        IMAGE_PLACEHOLDER in rendered.text and mask[ids == builtin_profiles["qwen2.5-vl"].special.image_pad].sum() == 0
    )


def test_leading_newlines_merge_into_the_header_token(builtin_profiles):
    """ "\n" of the header + "\n\n" of the content are one BPE token starting in the header:
    not a target (documented rule); the rest of the content is."""
    tokenizer = builtin_profiles["qwen3-vl"].tokenizer
    rendered = render_conversation(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\nanswer"}], family=family_named("qwen3-vl")
    )
    ids, mask = tokenize_rendered(rendered, tokenizer)
    pieces = [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]
    header = pieces.index("assistant")
    assert pieces[header + 1] == "\n\n\n" and mask[header + 1] == 0
    assert "".join(p for p, m in zip(pieces, mask, strict=True) if m) == "answer<|im_end|>"


def test_tool_call_newline_follows_raw_content_truthiness():
    """`(loop.first and message.content)`: a list holding one empty text part is truthy."""
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    base = [{"role": "user", "content": "q"}]
    with_list = render_conversation(
        base + [{"role": "assistant", "content": [{"type": "text", "text": ""}], "tool_calls": [call]}],
        family=family_named("qwen3-vl"),
    )
    with_empty = render_conversation(
        base + [{"role": "assistant", "content": "", "tool_calls": [call]}], family=family_named("qwen3-vl")
    )
    assert "assistant\n\n<tool_call>" in with_list.text
    assert "assistant\n<tool_call>" in with_empty.text


def test_unknown_policy_and_family_are_value_errors():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError):
        render_conversation(messages, family=family_named("qwen3-vl"), loss_policy="everything")
    with pytest.raises(ValueError):
        family_named("llama")


# ---------------------------------------------------------------------------------------------
# Rejects
# ---------------------------------------------------------------------------------------------

Q = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}
CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
BOTH = ("qwen3-vl", "qwen2.5-vl")

# (code, families, messages, tools, text the message must contain)
REJECTS = [
    ("no_messages", BOTH, None, None, "non-empty list"),
    ("no_messages", BOTH, [], None, "non-empty list"),
    ("no_messages", BOTH, {"role": "user"}, None, "non-empty list"),
    ("bad_message", BOTH, [Q, "hello"], None, "message 1"),
    ("bad_message", BOTH, [{"content": "q"}, A], None, "missing role"),
    ("bad_message", BOTH, [Q, dict(A, train="yes")], None, "train"),
    ("bad_message", BOTH, [dict(Q, train=True), A], None, "only assistant"),
    ("unknown_role", BOTH, [{"role": "developer", "content": "x"}, Q, A], None, "'developer'"),
    ("bad_content", BOTH, [{"role": "user", "content": 5}, A], None, "message 0"),
    ("bad_content", BOTH, [{"role": "user"}, A], None, "message 0"),
    ("bad_content", BOTH, [{"role": "user", "content": {"text": "q"}}, A], None, "string or a list"),
    ("bad_content", BOTH, [{"role": "user", "content": ["q"]}, A], None, "content[0]"),
    (
        "bad_content",
        BOTH,
        [{"role": "user", "content": [{"type": "text", "text": None}]}, A],
        None,
        "text must be a string",
    ),
    ("bad_content", BOTH, [{"role": "user", "content": [{"type": "text"}]}, A], None, "got no text"),
    ("bad_content", BOTH, [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}, A], None, "'audio'"),
    (
        "bad_content",
        BOTH,
        [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}, A],
        None,
        "'input_text'",
    ),
    ("bad_content", BOTH, [{"role": "user", "content": [{"type": "image"}]}, A], None, "string source"),
    ("bad_content", BOTH, [{"role": "user", "content": [{"type": "image_url"}]}, A], None, "string source"),
    (
        "bad_content",
        BOTH,
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}, A],
        None,
        "string source",
    ),
    ("bad_video_option", BOTH, [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "fps": -1}]}, A],
     None, "`fps` must be a positive number"),
    ("bad_video_option", BOTH, [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "nframes": 2.5}]}, A],
     None, "`nframes` must be a positive integer"),
    ("bad_video_option", BOTH,
     [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "fps": 1, "nframes": 4}]}, A], None,
     "mutually exclusive"),
    ("bad_video_option", BOTH, [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "nframes": "8"}]}, A],
     None, "got '8' (a string: give a JSON number)"),
    ("bad_video_option", BOTH, [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "fps": 1e-4}]}, A],
     None, "at least 0.001"),
    ("bad_video_option", BOTH,
     [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "min_pixels": 9, "max_pixels": 8}]}, A], None,
     "`min_pixels` 9 is more than `max_pixels` 8"),
    ("bad_image_option", BOTH, [{"role": "user", "content": [{"type": "image", "image": "a.png", "max_pixels": 2**60}]},
                                A], None, "`max_pixels` must be a positive integer, at most 2**53"),
    ("bad_image_option", BOTH, [{"role": "user", "content": [{"type": "image", "image": "a.png", "min_pixels": True}]},
                                A], None, "got True"),
    ("unsupported_field", BOTH,
     [{"role": "user", "content": [{"type": "image", "image": "a.png", "resized_height": 280}]}, A], None,
     "`resized_height` (qwen-vl-utils' fixed size) is not supported"),
    ("unsupported_field", BOTH,
     [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "resized_height": 28, "resized_width": 28}]},
      A], None, "`resized_height` and `resized_width`"),
    ("bad_content", BOTH, [{"role": "user", "content": [{"type": "video", "video": []}]}, A], None, "non-empty list"),
    ("bad_content", BOTH, [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": 3}}]}, A], None,
     "video part without a source"),
    ("dropped_by_template", BOTH, [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "text": "t"}]}, A],
     None, "would drop its text"),
    ("dropped_by_template", ("qwen3-vl",), [Q, {"role": "assistant", "content": [{"type": "video", "video": "v"}]}], None,
     "drops videos inside assistant"),
    ("dropped_by_template", ("qwen3-vl",), [Q, {"role": "system", "content": "late"}, A], None, "message 1"),
    (
        "dropped_by_template",
        ("qwen3-vl",),
        [{"role": "system", "content": [{"type": "image", "image": "s.png"}]}, Q, A],
        None,
        "images inside system",
    ),
    (
        "dropped_by_template",
        ("qwen3-vl",),
        [Q, {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}],
        None,
        "images inside assistant",
    ),
    (
        "dropped_by_template",
        ("qwen2.5-vl",),
        [Q, {"role": "assistant", "content": "", "tool_calls": [CALL]}],
        None,
        "tool_calls",
    ),
    ("dropped_by_template", ("qwen2.5-vl",), [Q, A], [{"type": "function", "function": {"name": "f"}}], "tools"),
    ("dropped_by_template", BOTH, [dict(Q, tool_calls=[CALL]), A], None, "user message"),
    ("dropped_by_template", BOTH, [Q, dict(A, reasoning_content="hmm")], None, "reasoning_content"),
    (
        "dropped_by_template",
        BOTH,
        [{"role": "user", "content": [{"type": "image", "image": "i.png", "text": "cap"}]}, A],
        None,
        "drop its text",
    ),
    (
        "bad_tool_call",
        ("qwen3-vl",),
        [Q, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
        None,
        "name",
    ),
    (
        "bad_tool_call",
        ("qwen3-vl",),
        [Q, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": [1]}}]}],
        None,
        "arguments",
    ),
    ("bad_tool_call", ("qwen3-vl",), [Q, {"role": "assistant", "tool_calls": [{"name": "f"}]}], None, "no arguments"),
    ("bad_tool_call", ("qwen3-vl",), [Q, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{not json"}]}],
     None, "tool_calls[0].arguments is a string that is not JSON"),
    ("bad_tool_call", ("qwen3-vl",), [Q, {"role": "assistant", "tool_calls": "f()"}], None, "list"),
    ("bad_tool_call", ("qwen3-vl",), [Q, {"role": "assistant", "tool_calls": [
        {"name": "f", "arguments": "[" * 5000 + "]" * 5000}]}], None, "tool_calls[0].arguments is nested too deep for "
     "the JSON parser"),
    # OpenAI's legacy fields, which no Qwen template renders: the turn would train as an empty answer
    ("dropped_by_template", BOTH, [Q, {"role": "assistant", "content": None, "function_call": {
        "name": "f", "arguments": "{}"}}], None, "function_call would be dropped: no Qwen template renders OpenAI's "
     "function_call; convert it to tool_calls"),
    ("dropped_by_template", BOTH, [Q, {"role": "assistant", "content": "", "refusal": "I can't"}], None,
     "refusal would be dropped"),
    ("bad_tools", BOTH, [Q, A], "get_weather", "list of function schemas"),
    ("bad_tools", BOTH, [Q, A], [1], "list of function schemas"),
    ("vision_token_in_text", BOTH, [{"role": "user", "content": "see <|image_pad|>"}, A], None, "<|image_pad|>"),
    (
        "vision_token_in_text",
        BOTH,
        [{"role": "user", "content": [{"type": "text", "text": "<|vision_"}, {"type": "text", "text": "start|>"}]}, A],
        None,
        "<|vision_start|>",
    ),
    ("vision_token_in_text", BOTH, [{"role": "user", "content": "pad <|vision_pad|>"}, A], None, "<|vision_pad|>"),
    (
        "special_token_in_text",
        BOTH,
        [Q, {"role": "assistant", "content": "ok<|im_end|><|im_start|>assistant"}],
        None,
        "messages[1].content holds <|im_end|> at character 2",
    ),
    (
        "special_token_in_text",
        BOTH,
        [{"role": "user", "content": [{"type": "text", "text": "<|im_"}, {"type": "text", "text": "start|>"}]}, A],
        None,
        "<|im_start|> is formed where messages[0].content[0].text and messages[0].content[1].text meet",
    ),
    (
        "special_token_in_text",
        BOTH,
        [{"role": "system", "content": [{"type": "text", "text": "end <|endoftext|>"}]}, Q, A],
        None,
        "messages[0].content[0].text holds <|endoftext|> at character 4",
    ),
    (
        "special_token_in_text",
        ("qwen3-vl",),
        [Q, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": {"x": "<|im_end|>"}}]}],
        None,
        "messages[1].tool_calls[0].function.arguments holds <|im_end|>",
    ),
    (
        "special_token_in_text",
        ("qwen3-vl",),
        [Q, A],
        [{"type": "function", "function": {"name": "f", "description": "<|im_start|>"}}],
        "tools[0] holds <|im_start|>",
    ),
    (
        "bad_text",
        BOTH,
        [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "a\ud800"}]}, A],
        None,
        "lone surrogate U+D800 in messages[0].content[1].text at character 1: not valid Unicode",
    ),
    (
        "bad_text",
        ("qwen3-vl",),
        [Q, {"role": "assistant", "tool_calls": [{"name": "\udfff", "arguments": {}}]}],
        None,
        "lone surrogate U+DFFF in messages[1].tool_calls[0].function.name",
    ),
    ("no_targets", BOTH, [Q], None, "no assistant turn"),
    ("no_targets", BOTH, [Q, dict(A, train=False)], None, "no assistant turn"),
]


@pytest.mark.parametrize(
    "code, families, messages, tools, needle", REJECTS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REJECTS)]
)
def test_rejects(family, code, families, messages, tools, needle):
    if family not in families:
        pytest.skip(f"{code} case is specific to {families}")
    with pytest.raises(RejectError) as err:
        render_conversation(messages, family=family_named(family), tools=tools)
    assert err.value.code == code
    assert needle in err.value.message


def test_a_boolean_refusal_flag_is_no_refusal_text():
    rendered = render_conversation([Q, dict(A, refusal=False, function_call=None)], family=family_named("qwen3-vl"))
    assert rendered.text.endswith(A["content"] + "<|im_end|>\n")


def test_every_reject_code_is_exercised():
    assert {r[0] for r in REJECTS} == set(REJECT_CODES)


def test_control_tokens_in_text_become_structure_in_hf(family, hf_tokenizers, official_template):
    """Why `special_token_in_text` rejects: HF's template + tokenizer read the typed text as
    control tokens, so the assistant turn ends early and a second assistant header appears."""
    tokenizer = hf_tokenizers[family]
    messages = [Q, {"role": "assistant", "content": "ok<|im_end|><|im_start|>assistant\nmore"}]
    _, ids = hf_render(tokenizer, official_template[family], messages, None)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    clean_ids = hf_render(tokenizer, official_template[family], [Q, A], None)[1]
    assert ids.count(im_start) == clean_ids.count(im_start) + 1
    assert ids.count(im_end) == clean_ids.count(im_end) + 1
    with pytest.raises(RejectError) as err:
        render_conversation(messages, family=family_named(family))
    assert err.value.code == "special_token_in_text"


def test_grounding_tokens_and_plain_added_tokens_stay_text_as_in_hf(
    family, builtin_profiles, hf_tokenizers, official_template
):
    """Grounding markup (special tokens) and <think>/<tool_call> (added, not special) are kept
    and tokenized exactly as HF does."""
    profile = builtin_profiles[family]
    messages = [
        {"role": "user", "content": "Where is the cat? <tool_call> <think>"},
        {
            "role": "assistant",
            "content": "<think>look</think><|object_ref_start|>cat<|object_ref_end|>"
            "<|box_start|>(1,2),(3,4)<|box_end|><|quad_start|>q<|quad_end|>",
        },
    ]
    rendered = render_conversation(messages, family=family_named(family), special_tokens=profile.text_special_tokens)
    text, ids = hf_render(hf_tokenizers[family], official_template[family], messages, None)
    assert rendered.text == text
    assert tokenize_rendered(rendered, profile.tokenizer)[0].tolist() == ids
    assert profile.tokenizer.token_to_id("<|box_start|>") in ids


def test_text_special_tokens_come_from_the_tokenizer(builtin_profiles):
    """A tokenizer with an extra special token (a --model DIR checkpoint) forbids it in text too."""
    import dataclasses

    from tokenizers import AddedToken, Tokenizer

    profile = builtin_profiles["qwen3-vl"]
    assert set(profile.text_special_tokens) == {
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    }  # fmt: skip
    tokenizer = Tokenizer.from_str(profile.tokenizer_json)
    tokenizer.add_special_tokens([AddedToken("<|tool_sep|>", special=True)])
    custom = dataclasses.replace(profile, tokenizer_json=tokenizer.to_str())
    assert "<|tool_sep|>" in custom.text_special_tokens
    messages = [Q, {"role": "assistant", "content": "a<|tool_sep|>b"}]
    assert render_conversation(messages, family=family_named("qwen3-vl")).text.count("<|tool_sep|>") == 1
    with pytest.raises(RejectError, match="special_token_in_text: messages.1..content holds <.tool_sep.>"):
        render_conversation(messages, family=family_named("qwen3-vl"), special_tokens=custom.text_special_tokens)


def test_last_assistant_train_false_leaves_no_targets():
    with pytest.raises(RejectError) as err:
        render_conversation([Q, A, Q, dict(A, train=False)], family=family_named("qwen3-vl"), loss_policy="last_assistant")
    assert err.value.code == "no_targets"


@pytest.mark.parametrize(
    "family_name, messages, tools, lost",
    [
        ("qwen3-vl", [Q, {"role": "system", "content": "LATE SYSTEM"}, A], None, "LATE SYSTEM"),
        (
            "qwen3-vl",
            [Q, {"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "image", "image": "a.png"}]}],
            None,
            "<|image_pad|>",
        ),
        ("qwen2.5-vl", [Q, {"role": "assistant", "content": "", "tool_calls": [CALL]}], None, "<tool_call>"),
        ("qwen2.5-vl", [Q, A], [{"type": "function", "function": {"name": "UNIQUE_TOOL"}}], "UNIQUE_TOOL"),
        *[(family, [Q, {"role": "assistant", "content": "", "function_call": {"name": "UNIQUE_CALL", "arguments": "{}"},
                        "refusal": "UNIQUE_REFUSAL"}], None, lost) for family in BOTH
          for lost in ("UNIQUE_CALL", "UNIQUE_REFUSAL")],
    ],
)
def test_dropped_by_template_rejects_are_real_losses(
    hf_tokenizers, official_template, family_name, messages, tools, lost
):
    """Proof from the oracle: what these rejects protect really is missing from HF's text."""
    text, _ = hf_render(hf_tokenizers[family_name], official_template[family_name], messages, tools)
    assert lost not in text
    with pytest.raises(RejectError, match="dropped_by_template"):
        render_conversation(messages, family=family_named(family_name), tools=tools)


# ---------------------------------------------------------------------------------------------
# check_template_matches
# ---------------------------------------------------------------------------------------------


def test_official_template_passes(family, builtin_profiles, official_template):
    check_template_matches(builtin_profiles[family], official_template[family])


def test_other_family_template_is_refused(family, builtin_profiles, official_template):
    other = next(f for f in official_template if f != family)
    with pytest.raises(ConfigError, match="not one vlmpack renders natively") as err:
        check_template_matches(builtin_profiles[family], official_template[other])
    assert "the template gives ..." in str(err.value) and ", vlmpack gives ..." in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "family_name, old, new, probe",
    [
        ("qwen3-vl", "You may call one or more functions", "You can call functions", "tools with system and tool call"),
        ("qwen3-vl", "{{- '\\n\\n' }}", "{{- '\\n' }}", "tools with system and tool call"),
        ("qwen3-vl", "'\\n<tool_response>\\n'", "'<tool_response>\\n'", "tools with system and tool call"),
        ("qwen2.5-vl", "You are a helpful assistant.", "You are Qwen.", "no system, multi-turn"),
        ("qwen3-vl", "<|vision_start|><|video_pad|><|vision_end|>", "<|vision_start|>CLIP<|video_pad|><|vision_end|>",
         "videos beside an image"),
        ("qwen2.5-vl", "<|vision_start|><|video_pad|><|vision_end|>", "<|vision_start|><|video_pad|> <|vision_end|>",
         "videos beside an image"),
    ],
)
def test_modified_template_is_refused(builtin_profiles, official_template, family_name, old, new, probe):
    template = official_template[family_name]
    assert old in template
    with pytest.raises(ConfigError) as err:
        check_template_matches(builtin_profiles[family_name], template.replace(old, new, 1))
    message = str(err.value)
    assert f"probe {probe!r}" in message and "not one vlmpack renders natively" in message


def test_broken_template_is_a_config_error(builtin_profiles):
    with pytest.raises(ConfigError, match="fails on probe"):
        check_template_matches(builtin_profiles["qwen3-vl"], "{% for m in messages %}{{ m.content | nosuchfilter }}")


def test_a_template_that_renders_without_end_is_refused_in_time(builtin_profiles, official_template, monkeypatch):
    """A template looping for hours is a ConfigError once the check's time is up, not a hang;
    the timer is gone afterwards (the next check runs to its end)."""
    import signal
    import time

    import preprocess.render as render

    monkeypatch.setattr(render, "TEMPLATE_CHECK_SECONDS", 1.0)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(ConfigError, match="takes longer than 1 s to render the probes") as err:
        check_template_matches(builtin_profiles["qwen3-vl"], endless)
    assert time.monotonic() - started < 30 and "probe 'system string'" in str(err.value)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    check_template_matches(builtin_profiles["qwen3-vl"], official_template["qwen3-vl"])


def test_model_dir_with_modified_template_is_refused(tmp_path, builtin_profiles, official_template):
    """The `--model DIR` path calls the check (profiles.profile_from_model_dir)."""
    from preprocess.profiles import profile_from_model_dir

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    (tmp_path / "tokenizer.json").write_text(builtin_profiles["qwen3-vl"].tokenizer_json, encoding="utf-8")
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "patch_size": 16,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3,
            }
        )
    )
    (tmp_path / "chat_template.jinja").write_text(official_template["qwen3-vl"], encoding="utf-8")
    assert profile_from_model_dir(tmp_path).family == "qwen3-vl"
    (tmp_path / "chat_template.jinja").write_text(official_template["qwen3-vl"].replace("<tools>", "<functions>"))
    with pytest.raises(ConfigError, match="not one vlmpack renders natively"):
        profile_from_model_dir(tmp_path)


def test_model_dir_template_is_checked_with_the_jobs_template_variables(tmp_path, builtin_profiles, official_template,
                                                                       capsys):
    """A checkpoint's own template that numbers images its own way passes the default probes
    (`add_vision_id` unset), so it serves a job without `--add-vision-id`; a job with it checks
    the template's branch too and is refused, exit 2, before any work."""
    from preprocess.examples import write_jsonl
    from shards_schema.cli import main as vlmpack

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    (model / "tokenizer.json").write_text(builtin_profiles["qwen3-vl"].tokenizer_json, encoding="utf-8")
    (model / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    own = official_template["qwen3-vl"].replace("Picture {{ image_count.value }}: ", "Image {{ image_count.value }}: ")
    assert own != official_template["qwen3-vl"]
    (model / "chat_template.jinja").write_text(own, encoding="utf-8")
    data = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}]}])
    common = ["preprocess", str(data), "--model", str(model), "--workers", "1", "--no-progress"]
    assert vlmpack([*common, "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert vlmpack([*common, "--out", str(tmp_path / "numbered"), "--add-vision-id"]) == 2
    err = capsys.readouterr().err
    assert "with add_vision_id" in err and "not one vlmpack renders natively" in err, err
    assert err.count("\n") == 1 and err.startswith("vlmpack preprocess: error: "), err
    assert not (tmp_path / "numbered").exists()


def test_vendored_templates_are_the_published_bytes():
    """Each vendored template's sha256 equals the one its provenance note records."""
    import hashlib

    from tests.conftest import FIXTURES_DIR, TEMPLATE_FILES, THINKING_TEMPLATE_FILE

    note = (FIXTURES_DIR / "README.md").read_text(encoding="utf-8")
    for path in [*TEMPLATE_FILES.values(), THINKING_TEMPLATE_FILE]:
        row = next(line for line in note.splitlines() if line.startswith(f"| `{path.name}`"))
        recorded = row.split("|")[4].strip().strip("`")
        assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded, path.name


def test_the_special_token_check_takes_time_linear_in_the_turns():
    """Every turn's markup is a special-token match; each is compared with the data pieces it
    overlaps only (pieces start in order), so a row of 40,000 turns is checked in well under a
    second where comparing each match with every later piece took minutes. A token in the
    last piece is still found."""
    import time

    from preprocess.render import _check_data_text

    parts, data, pos = [], [], 0
    for i in range(40000):
        piece = "the end <|im_end|>" if i == 39999 else f"turn {i}"
        parts += ["<|im_start|>user\n", piece, "<|im_end|>\n"]
        data.append((pos + 17, pos + 17 + len(piece), f"messages[{i}].content"))
        pos += 17 + len(piece) + 11
    text = "".join(parts)
    assert all(text[a:b] == parts[3 * i + 1] for i, (a, b, _) in enumerate(data))
    started = time.perf_counter()
    with pytest.raises(RejectError, match=r"messages\[39999\].content holds <\|im_end\|> at character 8"):
        _check_data_text(text, data, frozenset({"<|im_start|>", "<|im_end|>"}))
    assert time.perf_counter() - started < 3.0


def test_a_modified_qwen3_5_template_is_named_once_as_the_official_one():
    from preprocess.profiles import builtin_profile

    profile = builtin_profile("qwen3.5")
    template = profile.chat_template
    assert "<|im_start|>" in template
    with pytest.raises(ConfigError) as err:
        check_template_matches(profile, template.replace("<|im_start|>", "<|im_start|> ", 1))
    message = str(err.value)
    assert "the official qwen3.5 template" in message and "qwen3.5 qwen3.5" not in message, message
