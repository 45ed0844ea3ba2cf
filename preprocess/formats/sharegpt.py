"""ShareGPT rows (LLaMA-Factory's `sharegpt` format, LLaVA, Qwen's fine-tuning scripts) -> OpenAI rows.

    {"id": "...", "system": "...", "tools": "[{...}]",
     "conversations": [{"from": "human", "value": "<image>What is this?"},
                       {"from": "gpt", "value": "A cat."}],
     "images": ["cats/1.jpg"]}

Roles as LLaMA-Factory names them: `human` / `user`, `gpt` / `assistant`, `system`,
`function_call` (an assistant turn that calls tools: its value is the JSON of one call
`{"name", "arguments"}` or a list of them) and `observation` (a tool's output). A turn's `loss`
(true / false; null: the loss policy decides), as ms-swift writes it, is an assistant turn's
`train` flag, and its `reasoning_content` (or `thinking` / `reasoning`) is the message's own,
trained where the profile's template renders it (a Thinking template's assistant turns). LLaVA's single
`image` / `video` key is read like a one-element list. `tools` is a JSON string or a list of
function schemas (wrapped as `{"type": "function", "function": schema}` as the chat template
expects).
"""

from __future__ import annotations

from ..errors import RejectError, loads_or_reject
from ..render import REASONING_FIELDS
from .placeholders import MediaQueue, split_text, system_turn

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "function_call": "assistant", "observation": "tool"}


def to_openai(row: dict) -> dict:
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise RejectError("no_messages", "`conversations` must be a non-empty list of {\"from\", \"value\"} turns")
    queue = MediaQueue.from_row(row)
    messages = []
    if (system := system_turn(row)) is not None:
        messages.append(system)
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RejectError("bad_content", f"conversations[{k}] must be an object with `from` and `value`")
        speaker, value = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        role = ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise RejectError("unknown_role", f"conversations[{k}].from {speaker!r} is not one of {', '.join(ROLES)}")
        if not isinstance(value, str):
            raise RejectError("bad_content", f"conversations[{k}].value must be a string, got {type(value).__name__}")
        for key in ("train", "weight"):  # the OpenAI layout's flags: read here they would go unseen
            if key in turn:
                raise RejectError("unsupported_field", f"conversations[{k}].{key} is the OpenAI layout's key, which "
                                  "a ShareGPT turn does not have: write `loss: false` (or true) to set whether it "
                                  "is trained")
        train = loss_flag(turn, role == "assistant", f"conversations[{k}]")
        if speaker == "function_call":
            message = {"role": "assistant", "content": "", "tool_calls": tool_calls(value, f"conversations[{k}]")}
        else:
            message = {"role": role, "content": split_text(value, queue)}
        # a turn's reasoning goes on as it came: the renderer trains it where the template renders
        # it and rejects the row where the template would drop it
        message |= {name: turn[name] for name in REASONING_FIELDS if name in turn}
        messages.append(message if train is None else {**message, "train": train})
    queue.check_all_used()
    return {"id": row.get("id"), "messages": messages, "tools": tool_schemas(row.get("tools"))}


def loss_flag(turn: dict, trained_role: bool, where: str) -> bool | None:
    """A turn's `loss` (true, false, or null for the loss policy's choice; ms-swift's key) as the
    OpenAI row's `train` flag of an assistant turn; only assistant turns are trained."""
    loss = turn.get("loss")
    if loss is None:
        return None
    if not isinstance(loss, bool):
        raise RejectError("bad_message", f"{where}.loss must be true, false or null, got {type(loss).__name__} "
                          f"{ascii(loss):.80}")
    if loss and not trained_role:
        raise RejectError("bad_message", f"{where}: loss true on a turn that is not the assistant's (only assistant "
                          "turns are trained)")
    return loss if trained_role else None


def tool_calls(value: str, where: str) -> list[dict]:
    """One call's JSON `{"name", "arguments"}` (or a list of them) -> OpenAI `tool_calls`."""
    calls = loads_or_reject(value, "bad_tool_call",
                            f"{where}: a function call, which must be JSON {{\"name\", \"arguments\"}},")
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise RejectError("bad_tool_call", f"{where}: each function call needs a string `name`, got {value[:120]!r}")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def tool_schemas(tools) -> list[dict] | None:
    """`tools` as a JSON string or a list of function schemas -> the template's tool list."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        tools = loads_or_reject(tools, "bad_tools", "`tools`")
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RejectError("bad_tools", "`tools` must be a list of function schemas")
    return [t if "type" in t else {"type": "function", "function": t} for t in tools]
