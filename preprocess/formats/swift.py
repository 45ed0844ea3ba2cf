"""ms-swift rows (and the Hugging Face / TRL `messages` + `images` layout) -> OpenAI rows.

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "<image><image>What differs?"},
                  {"role": "assistant", "content": "..."}],
     "images": ["a.jpg", "b.jpg"], "videos": [], "tools": [...]}

String content: `<image>` / `<video>` tags are placeholders for the row's lists, in order.
Part-list content: a `{"type": "image"}` / `{"type": "video"}` part without a source of its own
takes the next entry of the same lists (the layout of TRL datasets, whose `images` column
holds `Image` features). Roles: `system`, `user`, `assistant`, `tool` / `tool_response` (a
tool's output) and `tool_call` (its content the JSON of one call, joined to the assistant
turn right before it, as ms-swift renders it). A message's `loss` (true / false; null: the
loss policy decides) is the assistant turn's `train` flag. A top-level `system` is the first
message, as ms-swift reads it; beside a system message of its own the row is rejected (ms-swift
would drop one of them unseen).
"""

from __future__ import annotations

from ..errors import RejectError
from .placeholders import MediaQueue, split_text, system_turn
from .sharegpt import loss_flag, tool_calls, tool_schemas

ROLES = ("system", "user", "assistant", "tool", "tool_response", "tool_call")


def to_openai(row: dict) -> dict:
    given = row.get("messages")
    if not isinstance(given, list) or not given:
        raise RejectError("no_messages", "`messages` must be a non-empty list")
    if row.get("objects"):
        raise RejectError("unsupported_field", "`objects` (ms-swift grounding boxes) is not supported: "
                          "write the boxes into the text, or drop the field")
    queue = MediaQueue.from_row(row)
    messages: list[dict] = []
    if (system := system_turn(row)) is not None:  # ms-swift's top-level system: the first message
        if isinstance(given[0], dict) and given[0].get("role") == "system":
            raise RejectError("bad_row", "the row has both a top-level `system` and a system message, messages[0]: "
                              "keep one of them")
        messages.append(system)
    for k, message in enumerate(given):
        if not isinstance(message, dict):
            raise RejectError("bad_content", f"messages[{k}] must be an object with `role` and `content`")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RejectError("unknown_role", f"messages[{k}].role {role!r} is not one of {', '.join(ROLES)}")
        train = loss_flag(message, role in ("assistant", "tool_call"), f"messages[{k}]")
        if role == "tool_call":
            if not isinstance(content, str):
                raise RejectError("bad_tool_call", f"messages[{k}]: a tool_call's content must be the JSON of the call")
            calls = tool_calls(content, f"messages[{k}]")
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant" and k and given[k - 1].get("role") in (
                    "assistant", "tool_call"):
                if train is not None and previous.setdefault("train", train) != train:
                    raise RejectError("bad_message", f"messages[{k}]: loss {str(train).lower()} differs from the "
                                      "assistant turn it joins; one turn is trained or not as a whole")
                previous.setdefault("tool_calls", []).extend(calls)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": calls,
                                 **({} if train is None else {"train": train})})
            continue
        converted = {key: value for key, value in message.items() if key not in ("role", "content", "loss")}
        if train is not None and role == "assistant":
            converted["train"] = train
        converted["role"] = "tool" if role == "tool_response" else role
        converted["content"] = _content(content, queue, k)
        messages.append(converted)
    queue.check_all_used()
    return {"id": row.get("id"), "messages": messages, "tools": tool_schemas(row.get("tools"))}


def _content(content, queue: MediaQueue, k: int):
    if isinstance(content, str):
        return split_text(content, queue)
    if content is None:
        return content  # an assistant turn of tool calls has none; the renderer judges the others
    if not isinstance(content, list):  # named here, before the media lists are found unused
        raise RejectError("bad_content", f"messages[{k}].content must be a string or a list of parts, got "
                          f"{type(content).__name__}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "video") and part.get(kind) is None and not any(
                part.get(key) is not None for key in (f"{kind}_url", "url", "path")):
            source = queue.take(kind)
            if source is None:
                raise RejectError("placeholder_mismatch", f"messages[{k}]: {kind} part number {queue.used[kind]} has "
                                  f"no {kind}: the row's {kind}s list holds {len(queue.media[kind])}")
            part = {**{key: value for key, value in part.items() if value is not None}, kind: source}
        parts.append(part)
    return parts
