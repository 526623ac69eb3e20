"""A request's conversation: its turns over the one list of content parts, checked and read (pure).

A request is one user turn (`parts`, then `prompt`, after an optional `system_prompt`) or a conversation:
`turns` in order, each taking the next `Turn.parts` of `parts`, with the `tools` the model may call and an
`answer_prefix` the answer starts with. All turns' parts stay in one list, so the media checks, the byte
bounds and the part indices a refusal names are those of a single turn. Every stage that renders a chat
prompt reads the conversation through `messages` (`stage_service.runtime.chat`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from omnistage.contract.errors import InvalidRequest
from omnistage.v1 import common_pb2

ROLES = ("system", "user", "assistant", "tool")
# A function's name as OpenAI's reference bounds it: the chat templates place it as written.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # matched whole (fullmatch)
MAX_TOOLS = 128        # functions offered to one request (OpenAI's reference allows 128)
MAX_TOOL_CALLS = 128   # calls one assistant turn made
MAX_CALL_ID_CHARS = 64


@dataclass(frozen=True)
class Message:
    """One turn as a chat template reads it: its role, its parts (with their indices in `parts`), the calls
    an assistant turn made, the call a tool turn answers."""

    role: str
    parts: tuple[tuple[int, common_pb2.ContentPart], ...]
    tool_calls: tuple[common_pb2.ToolCall, ...] = ()
    tool_call_id: str = ""
    index: int = 0  # its position in `turns`

    @property
    def field(self) -> str:
        return f"params.turns[{self.index}]"


def messages(p) -> list[Message]:
    """The conversation of a request (a GenerationParams or resolved RequestParams with `turns`) as
    messages; [] for a one-turn request."""
    out, at = [], 0
    for i, turn in enumerate(p.turns):
        n = turn.parts
        out.append(Message(turn.role, tuple((at + j, p.parts[at + j]) for j in range(n)), tuple(turn.tool_calls),
                           turn.tool_call_id, i))
        at += n
    return out


def check(p: common_pb2.GenerationParams, max_chars: int) -> int:
    """The structure of a request's conversation and tools; InvalidRequest names the first field wrong.
    Returns the characters the turns' calls and the tools add to the prompt (counted with the parts' text
    against `max_prompt_chars` by the caller)."""
    chars = 0
    if p.turns:
        if p.prompt or p.prompt_token_ids or p.system_prompt or p.raw_prompt:
            field = next(f for f in ("prompt", "prompt_token_ids", "system_prompt", "raw_prompt") if getattr(p, f))
            raise InvalidRequest(f"params.{field}", "cannot be used with params.turns (a conversation is its turns: "
                                                    "put the text in a turn)")
        total = sum(t.parts for t in p.turns)
        if total != len(p.parts):
            raise InvalidRequest("params.turns", f"take {total} parts together; params.parts has {len(p.parts)}")
        asked: set[str] = set()
        for i, turn in enumerate(p.turns):
            chars += _check_turn(turn, f"params.turns[{i}]", asked)
        if p.turns[-1].role in ("assistant", "system"):
            last = p.turns[-1].role
            raise InvalidRequest(f"params.turns[{len(p.turns) - 1}].role",
                                 f"a conversation ends with a turn to answer (user or tool), not {last}")
    elif p.tools or p.answer_prefix:
        field = "tools" if p.tools else "answer_prefix"
        raise InvalidRequest(f"params.{field}", "needs a conversation (params.turns)")
    if len(p.tools) > MAX_TOOLS:
        raise InvalidRequest("params.tools", f"has {len(p.tools)} functions; the limit is {MAX_TOOLS}")
    # Sized before any schema is checked: checking one costs time in its size.
    chars += sum(len(t.name) + len(t.description) + len(t.parameters) for t in p.tools) + len(p.answer_prefix)
    if chars > max_chars:
        raise InvalidRequest("params.tools" if p.tools else "params.turns",
                             f"the tools and tool calls are {chars} characters; the limit is {max_chars}")
    names: set[str] = set()
    for i, tool in enumerate(p.tools):
        _check_tool(tool, f"params.tools[{i}]", names)
    return chars


def _check_turn(turn: common_pb2.Turn, at: str, asked: set[str]) -> int:
    if turn.role not in ROLES:
        raise InvalidRequest(f"{at}.role", f'"{turn.role}" is not a role ({", ".join(ROLES)})')
    if turn.tool_calls and turn.role != "assistant":
        raise InvalidRequest(f"{at}.tool_calls", f"only an assistant turn makes tool calls, not a {turn.role} turn")
    if turn.role == "tool":
        if not turn.tool_call_id:
            raise InvalidRequest(f"{at}.tool_call_id", "is required on a tool turn (the call it answers)")
        if turn.tool_call_id not in asked:
            raise InvalidRequest(f"{at}.tool_call_id", f'"{turn.tool_call_id}" answers no tool call of an '
                                                       "assistant turn before it")
    elif turn.tool_call_id:
        raise InvalidRequest(f"{at}.tool_call_id", f"is for tool turns, not a {turn.role} turn")
    if not turn.parts and turn.role in ("user", "system"):
        raise InvalidRequest(f"{at}.parts", f"a {turn.role} turn needs content")
    if len(turn.tool_calls) > MAX_TOOL_CALLS:
        raise InvalidRequest(f"{at}.tool_calls", f"has {len(turn.tool_calls)} calls; the limit is {MAX_TOOL_CALLS}")
    chars = 0
    for j, call in enumerate(turn.tool_calls):
        where = f"{at}.tool_calls[{j}]"
        if not call.id or len(call.id) > MAX_CALL_ID_CHARS:
            raise InvalidRequest(f"{where}.id", f"must be 1 to {MAX_CALL_ID_CHARS} characters")
        if not TOOL_NAME.fullmatch(call.name):
            raise InvalidRequest(f"{where}.name", "must be 1 to 64 letters, digits, _ . or -")
        asked.add(call.id)
        chars += len(call.arguments) + len(call.name)
    return chars


def _check_tool(tool: common_pb2.Tool, at: str, names: set[str]) -> None:
    if not TOOL_NAME.fullmatch(tool.name):
        raise InvalidRequest(f"{at}.name", "must be 1 to 64 letters, digits, _ . or -")
    if tool.name in names:
        raise InvalidRequest(f"{at}.name", f'"{tool.name}" is offered twice')
    names.add(tool.name)
    if tool.parameters:
        schema = parameters(tool, at)
        check_schema(schema, f"{at}.parameters")


def parameters(tool: common_pb2.Tool, at: str = "params.tools") -> dict:
    """A tool's parameters schema as an object ({} when it has none)."""
    if not tool.parameters:
        return {}
    try:
        schema = json.loads(tool.parameters)
    except ValueError as e:
        raise InvalidRequest(f"{at}.parameters", f"is not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{at}.parameters", "must be a JSON Schema object")
    return schema


def check_schema(schema: dict, field: str) -> None:
    """`schema` is a valid JSON Schema (draft 2020-12, as OpenAI's function parameters are read)."""
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except RecursionError:
        raise InvalidRequest(field, "is nested too deeply to check as a JSON Schema") from None
    except SchemaError as e:
        where = "/".join(str(x) for x in e.path)
        raise InvalidRequest(field, f"is not a JSON Schema: {e.message}" + (f" (at {where})" if where else "")) \
            from None


def tool_dicts(tools) -> list[dict]:
    """The tools as chat templates take them (OpenAI's shape: {"type": "function", "function": {...}})."""
    out = []
    for t in tools:
        function: dict = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = parameters(t) if t.parameters else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return out
