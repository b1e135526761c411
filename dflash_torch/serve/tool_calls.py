"""Tool calls in the model's text -> OpenAI `tool_calls`.

The chat templates of Qwen2.5 / Qwen3 / Hermes-style models show the model the tools as JSON schemas and
have it answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; Qwen3-Coder and
Qwen3.5 write the inside as XML instead: `<function=NAME><parameter=KEY>VALUE</parameter>...</function>`
(a value is JSON unless the tool's schema says the parameter is a string). Llama 3.x answers a call
with the bare JSON as the whole reply (`{"name": ..., "parameters": {...}}`, several joined by ";").
`ToolCallStream` sits
after the stop-string filter: text before the first `<tool_call>` streams as content as usual (a tail
that could be the start of the marker is held back), everything from the marker on is held and parsed
when the generation ends. A block that is not a JSON call of a declared tool leaves the whole held text
as content: nothing the model wrote is dropped. A reply that starts with "{" is held whole (it may be a
bare call) and handed out at the end if it is not one.
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
        self.tools = {t["function"]["name"]: t["function"] for t in tools}
        self.held = ""  # text not handed out yet
        self.in_call = False  # the marker has been seen: hold everything
        self.started = False  # something but whitespace has come
        self.bare = False  # the reply starts with "{": maybe bare JSON calls (Llama 3.x)

    def feed(self, delta: str) -> str:
        """The content that can go out now."""
        if self.in_call:
            self.held += delta
            return ""
        text = self.held + delta
        if not self.started:
            if not text.strip():
                self.held = text
                return ""
            self.started = True
            if text.lstrip().startswith("{"):
                self.in_call = self.bare = True
                self.held = text
                return ""
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
        if self.bare:
            calls = [parse_call(part, self.tools) for part in _json_objects(rest)]
            return ("", calls) if calls and all(calls) else (rest, [])
        calls = []
        for block in _BLOCK.finditer(rest):
            call = parse_call(block.group(1), self.tools)
            if call is None:
                return rest, []
            calls.append(call)
        if _BLOCK.sub("", rest).strip():  # prose between or after the calls: keep it all as content
            return rest, []
        return "", calls


_XML_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*\Z", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


def parse_call(text: str, tools: dict[str, dict]) -> dict | None:
    """The inside of a `<tool_call>` block -> an OpenAI tool call, or None when it is not a call of one of
    `tools` ({name: function schema}). JSON: '{"name": "f", "arguments": {...}}' (arguments may also come
    as a JSON string, or under "parameters"); XML: '<function=f><parameter=k>v</parameter></function>'."""
    xml = _XML_FUNCTION.match(text)
    if xml:
        name = xml.group(1)
        if name not in tools:
            return None
        props = tools[name].get("parameters", {}).get("properties", {})
        args = {}
        for key, raw in _XML_PARAMETER.findall(xml.group(2)):
            value = raw.removeprefix("\n").removesuffix("\n")
            if props.get(key, {}).get("type") != "string":
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    pass  # not JSON: the text itself
            args[key] = value
        if _XML_PARAMETER.sub("", xml.group(2)).strip():  # something besides parameters: not a clean call
            return None
        return _call(name, args)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return _call(obj["name"], args)


def _json_objects(text: str) -> list[str]:
    """'{...}; {...}' -> the JSON objects' texts; [] if anything else is in between or around."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (text[i] == ";" and out)):
            i += 1
        if i == len(text):
            return out
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        out.append(text[i:end])
        i = end


def _call(name: str, args: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def forced_call_grammar(template: str, tools: list[dict], name: str | None = None) -> str | None:
    """A Lark grammar (llguidance's dialect, JSON schemas embedded with %json) that makes the reply one
    call of a declared tool (`name`: that one), in the call format the chat template teaches: a
    `<tool_call>` JSON block, or bare JSON with "parameters" (Llama 3.x). None for a template whose format
    it cannot force (Qwen3-Coder's XML)."""
    if "<function=" in template:
        return None
    key = "arguments" if OPEN in template else "parameters"
    if key == "parameters" and "parameters" not in template:  # no call format this can tell
        return None
    schemas = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                "properties": {"name": {"const": t["function"]["name"]},
                               key: t["function"].get("parameters") or {"type": "object"}}}
               for t in tools if name is None or t["function"]["name"] == name]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # one line of JSON spaced as the templates show calls: free whitespace lets a model pad forever
    call = json.dumps(call | {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                             "key_separator": ": "}})
    if key == "arguments":
        return f'start: "{OPEN}" NL call NL "{CLOSE}"\ncall: %json {call}\nNL: /\\n?/\n'
    return f"start: call\ncall: %json {call}\n"
