"""Tool calls in the model's text -> OpenAI `tool_calls`.

The chat templates of Qwen2.5 / Qwen3 / Hermes-style models show the model the tools as JSON schemas and
have it answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. `ToolCallStream` sits
after the stop-string filter: text before the first `<tool_call>` streams as content as usual (a tail
that could be the start of the marker is held back), everything from the marker on is held and parsed
when the generation ends. A block that is not a JSON call of a declared tool leaves the whole held text
as content: nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)


class ToolCallStream:
    """Assistant text deltas in, content deltas out; `finish()` gives the rest and the calls."""

    def __init__(self, tools: list[dict]) -> None:
        self.names = {t["function"]["name"] for t in tools}
        self.held = ""  # text not handed out yet
        self.in_call = False  # the marker has been seen: hold everything

    def feed(self, delta: str) -> str:
        """The content that can go out now."""
        if self.in_call:
            self.held += delta
            return ""
        text = self.held + delta
        i = text.find(OPEN)
        if i >= 0:
            self.in_call, self.held = True, text[i:]
            return text[:i]
        k = max((k for k in range(1, len(OPEN)) if text.endswith(OPEN[:k])), default=0)
        self.held = text[len(text) - k:] if k else ""
        return text[: len(text) - k]

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not handed out yet, the tool calls in OpenAI's shape)."""
        rest, self.held = self.held, ""
        if not self.in_call:
            return rest, []
        calls = []
        for block in _BLOCK.finditer(rest):
            call = parse_call(block.group(1), self.names)
            if call is None:
                return rest, []
            calls.append(call)
        if _BLOCK.sub("", rest).strip():  # prose between or after the calls: keep it all as content
            return rest, []
        return "", calls


def parse_call(text: str, names: set[str]) -> dict | None:
    """'{"name": "f", "arguments": {...}}' -> an OpenAI tool call, or None when it is not a call of one of
    `names` (arguments may also come as a JSON string, or under "parameters")."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
