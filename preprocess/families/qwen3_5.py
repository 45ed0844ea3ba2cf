"""Qwen3.5 and Qwen3.6 (model_type `qwen3_5` / `qwen3_5_moe`): their chat templates, rendered
natively, and their processors' video rules.

Templates (`render`): one template per release, each with thinking built in (kinds `qwen3.5`
and `qwen3.6`, the built-in profiles of the same names). Every message's content is trimmed
(jinja `|trim`). A system message may only come first (the template raises otherwise) and
holds text only; tools go into that system turn, after the fixed function-calling
instructions. An assistant turn after the last user query opens with a `<think>` block:
`<think>\\n{reasoning}\\n</think>\\n\\n`, the reasoning coming from `reasoning_content` or from
a `<think>...</think>` block at the start of the content; an empty one,
`<think>\\n\\n</think>\\n\\n`, is what the generation prompt writes with thinking off
(`enable_thinking=False`), so a turn without reasoning is a thinking-off turn and its empty
block is context, while a turn with reasoning trains it (or not: `reasoning_loss`) after the
`<think>\\n` that the thinking-on generation prompt ends with. Turns before the last user query
render without the block: their reasoning would be dropped, so such rows are rejected, unless
Qwen3.6's `preserve_thinking` (`--preserve-thinking`) keeps the block in every turn. Tool
calls are XML (`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...`);
Qwen3.5 writes a value that is not an object or a list with Python's `str` (`True`, `None`),
Qwen3.6 as JSON (`true`, `null`), the one difference of the two templates besides
`preserve_thinking`. Tool results are `<tool_response>` blocks of one user turn; images and
videos render in user, assistant and tool turns.

Processors: transformers gives these checkpoints Qwen3-VL's (`Qwen3VLProcessor`,
`Qwen2VLImageProcessor`, `Qwen3VLVideoProcessor`) with the same published constants
(`qwen3_5_constants`), so the video sampling and resize rules are Qwen3-VL's, inherited from
`qwen3_vl.Qwen3VL`; so are the video token layout and positions (`shards_schema.families.qwen3_5`).
"""

from __future__ import annotations

import json

from shards_schema.families import qwen3_5 as shard_qwen3_5

from ..render import (IM_END, IM_START, IMAGE, IMAGE_PLACEHOLDER, TEXT, VIDEO, VIDEO_PLACEHOLDER, Message, TextBuilder,
                      json_text, reject)
from .qwen3_5_constants import QWEN3_5_VIDEO
from .qwen3_vl import Qwen3VL

QWEN3_5_TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN3_5_TOOLS_OUTRO = (
    "\n</tools>"
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
THINK_OPEN = "<think>\n"  # what the thinking-on generation prompt ends with
THINK_CLOSE = "\n</think>\n\n"


def _trimmed(items: list) -> list:
    """Content items as jinja's `render_content(...)|trim` leaves them: whitespace stripped
    from the start of the first text and the end of the last (images and videos are not
    whitespace; a text that strips to nothing is left out)."""
    items = list(items)
    while items and items[0][0] == TEXT:
        kind, text, where = items[0]
        if text.lstrip():
            items[0] = (kind, text.lstrip(), where)
            break
        items.pop(0)
    while items and items[-1][0] == TEXT:
        kind, text, where = items[-1]
        if text.rstrip():
            items[-1] = (kind, text.rstrip(), where)
            break
        items.pop()
    return items


def _flat(items: list) -> str:
    """The content text as the template sees it, each image and video as its placeholder."""
    return "".join(value if kind == TEXT else IMAGE_PLACEHOLDER if kind == IMAGE else VIDEO_PLACEHOLDER
                   for kind, value, _ in items)


def _has_visual(message: Message) -> str | None:
    return next((kind for kind, _, _ in message.items if kind in (IMAGE, VIDEO)), None)


def _last_query_index(messages: list[Message]) -> int | None:
    """The last user message that is not wholly a `<tool_response>` block; None: no such message
    (the template raises "No user query found in messages")."""
    for message in reversed(messages):
        if message.role == "user":
            text = _flat(_trimmed(message.items))
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                return message.index
    return None


def _argument_text(value, *, json_scalars: bool, index: int, where: str) -> str:
    """One tool-call argument's value as the template writes it inside `<parameter=...>`. A
    value JSON cannot hold (NaN, an infinity) is rejected under both templates, though Qwen3.5's
    `|string` would write it (`nan`): the arguments are JSON, and a target must be too."""
    if isinstance(value, str):
        return value
    text = json_text(value, "bad_tool_call", index, where)
    if isinstance(value, (dict, list, tuple)) or json_scalars:
        return text
    return str(value)  # Qwen3.5: jinja's `|string` (Python's str: True, None, 0.5)


class _RepeatedKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_without_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        raise _RepeatedKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return obj


def _arguments(message: Message, k: int) -> dict:
    arguments = message.tool_call_arguments[k]
    if isinstance(arguments, str):  # OpenAI's JSON string: its object, which the template iterates
        try:
            arguments = json.loads(arguments, object_pairs_hook=_object_without_repeated_keys)
        except _RepeatedKey as exc:  # the object would keep the last value: the others vanish
            raise reject("bad_tool_call", message.index, f"tool_calls[{k}].arguments gives the key {exc.key!r} more "
                         "than once in one object: the template reads the object, which keeps the last value, so "
                         "the others would be dropped; give each key once") from None
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict) or not all(isinstance(key, str) for key in arguments):
        raise reject("bad_tool_call", message.index, f"tool_calls[{k}].arguments must be an object (or a JSON string "
                     "of one): the template writes each argument as a <parameter=name> block")
    return arguments


def _render_tool_calls(out: TextBuilder, message: Message, target: bool, content_truthy: bool,
                       json_scalars: bool) -> None:
    for k, (name, _) in enumerate(message.tool_calls):
        where = f"messages[{message.index}].tool_calls[{k}].function"
        separator = ("\n\n" if content_truthy else "") if k == 0 else "\n"
        out.add(separator + "<tool_call>\n<function=", target)
        out.add(name, target, f"{where}.name")
        out.add(">\n", target)
        for key, value in _arguments(message, k).items():
            out.add("<parameter=", target)
            out.add(key, target, f"{where}.arguments")
            out.add(">\n", target)
            out.add(_argument_text(value, json_scalars=json_scalars, index=message.index,
                                   where=f"tool_calls[{k}].arguments.{key}"), target, f"{where}.arguments.{key}")
            out.add("\n</parameter>\n", target)
        out.add("</function>\n</tool_call>", target)


def _split_reasoning(message: Message, items: list) -> tuple[str, str, list]:
    """(reasoning, where, content items): `reasoning_content` when given, else the template's cut
    of a `</think>` in the content; what the cut would drop is rejected."""
    if message.reasoning is not None:
        return message.reasoning, f"messages[{message.index}].reasoning_content", items
    text = _flat(items)
    if "</think>" not in text:
        return "", "", items
    if _has_visual(message):
        raise reject("bad_content", message.index, "an assistant turn with both images or videos and a "
                     "<think>...</think> block is not supported; give the reasoning as reasoning_content")
    where = items[0][2]
    parts = text.split("</think>")
    head = parts[0].rstrip("\n").split("<think>")
    if len(parts) > 2 or len(head) > 2 or head[0]:
        raise reject("dropped_by_template", message.index, "the template keeps one <think>...</think> block at the "
                     "start of an assistant turn; text before it or a second block would be dropped")
    return head[-1].lstrip("\n"), where, [(TEXT, parts[-1].lstrip("\n"), where)]


def _render_assistant(out: TextBuilder, message: Message, target: bool, after_query: bool,
                      reasoning_loss: str, json_scalars: bool) -> None:
    reasoning, reasoning_where, items = _split_reasoning(message, _trimmed(message.items))
    reasoning = reasoning.strip()
    if after_query:
        out.add(IM_START + "assistant\n" + THINK_OPEN)
        if reasoning:  # thinking on: the model writes its reasoning after the prompt's "<think>\n"
            think = target and reasoning_loss == "train"
            out.add(reasoning, think, reasoning_where)
            out.add(THINK_CLOSE, think)
        else:  # thinking off: the empty block is the prompt's (`enable_thinking=False`)
            out.add(THINK_CLOSE)
    else:
        if reasoning:
            raise reject("dropped_by_template", message.index, "the template drops the reasoning of an assistant "
                         "turn before the last user message; give each turn its own row (Qwen3.6's template keeps "
                         "it with --preserve-thinking)")
        out.add(IM_START + "assistant\n")
    out.add_items(items, target)
    _render_tool_calls(out, message, target, bool(_flat(items).strip()), json_scalars)
    out.add(IM_END, target)
    out.add("\n")


def _render_tool_result(out: TextBuilder, messages: list[Message], i: int) -> None:
    """Consecutive tool results share one user turn, each wrapped in <tool_response>."""
    if messages[i - 1].role != "tool":
        out.add(IM_START + "user")
    out.add("\n<tool_response>\n")
    out.add_items(_trimmed(messages[i].items))
    out.add("\n</tool_response>")
    if i == len(messages) - 1 or messages[i + 1].role != "tool":
        out.add(IM_END + "\n")


def _render_system(out: TextBuilder, system: Message | None, tools: list[dict]) -> None:
    items = _trimmed(system.items) if system is not None else []
    if tools:
        out.add(IM_START + "system\n" + QWEN3_5_TOOLS_INTRO)
        for k, tool in enumerate(tools):
            out.add("\n")
            out.add(json_text(tool, "bad_tools", None, f"tools[{k}]"), where=f"tools[{k}]")
        out.add(QWEN3_5_TOOLS_OUTRO)
        if items:
            out.add("\n\n")
            out.add_items(items)
        out.add(IM_END + "\n")
    elif system is not None:
        out.add(IM_START + "system\n")
        out.add_items(items)
        out.add(IM_END + "\n")


def render_qwen3_5(out: TextBuilder, messages: list[Message], tools: list[dict], targets: list[bool], *,
                   json_scalars: bool, reasoning_loss: str = "train", preserve_thinking: bool = False) -> None:
    """The conversation as the official Qwen3.5 (`json_scalars=False`) or Qwen3.6 template
    renders it without a generation prompt, targets marked; `preserve_thinking` (Qwen3.6's
    variable): every assistant turn opens with its <think> block, not only those after the last
    user query."""
    system = messages[0] if messages[0].role == "system" else None
    _render_system(out, system, tools)
    last_query = _last_query_index(messages)
    for i, message in enumerate(messages):
        if message.role == "user":
            out.add(IM_START + "user\n")
            out.add_items(_trimmed(message.items))
            out.add(IM_END + "\n")
        elif message.role == "assistant":
            _render_assistant(out, message, targets[i], preserve_thinking or i > last_query, reasoning_loss,
                              json_scalars)
        elif message.role == "tool":
            _render_tool_result(out, messages, i)
        # system: rendered above (only as the first message; `reject_dropped_content` rejects any other)


class Qwen3_5(Qwen3VL):
    """Qwen3.5 / Qwen3.6's preprocessing rules (interface: `preprocess.families.ModelFamily`);
    the video processor's rules are Qwen3-VL's, inherited."""

    name = "qwen3.5"
    shard_rules = shard_qwen3_5.RULES
    templates = ("qwen3.5", "qwen3.6")
    reasoning_templates = ("qwen3.5", "qwen3.6")  # both render <think> blocks
    preserve_thinking_templates = ("qwen3.6",)
    # sha256 of the official chat_template.jinja of each template the renderer reproduces
    official_template_sha256 = {
        "qwen3.5": "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
        "qwen3.6": "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259",
    }
    builtin_video = QWEN3_5_VIDEO
    example_tool_call_share = 0.1  # its templates render tool calls: the examples show some

    def reject_dropped_content(self, messages: list[Message], tools: list[dict], template: str) -> None:
        """What the template refuses (it raises) is rejected as a bad row; what it would drop is
        rejected in `render` as `dropped_by_template` (reasoning before the last user query, text
        around a <think> block)."""
        for m in messages:
            if m.role == "system" and m.index != 0:
                raise reject("bad_message", m.index, "the template takes a system message only as the first message")
            visual = _has_visual(m)
            if m.role == "system" and visual:
                raise reject("bad_content", m.index, f"the template takes no {visual}s in a system message; put them "
                             "in a user turn")
        if messages[0].role == "tool":
            raise reject("bad_message", 0, "a tool result cannot be the first message: the template writes it without "
                         "its user turn")
        if _last_query_index(messages) is None:
            raise reject("bad_message", None, "no user query: the template needs a user message that is not only "
                         "<tool_response> blocks")

    def render(self, out: TextBuilder, messages: list[Message], tools: list[dict], targets: list[bool], template: str,
               reasoning_loss: str, preserve_thinking: bool) -> None:
        render_qwen3_5(out, messages, tools, targets, json_scalars=template == "qwen3.6", reasoning_loss=reasoning_loss,
                       preserve_thinking=preserve_thinking)


FAMILY = Qwen3_5()
