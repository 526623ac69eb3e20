"""Which token ids a request's text prompt becomes: the one prompt policy of every text-in engine.

The prompt is the request's text: `prompt`, or its text parts and then `prompt` (`RequestParams.text`).
`prompt_token_ids` are taken as given; `raw_prompt` tokenizes the prompt as written (with the special
tokens the tokenizer adds to any text, as vLLM and transformers' pipelines do); otherwise the prompt is
the user turn of the checkpoint's chat template, after a system turn (the request's `system_prompt`, or
the model's default where it needs one), with the assistant generation prompt, rendered and tokenized
as the model's processor does it, except that the client's text is plain text: special tokens in it are
not recognised (`chat_tokens`). A model without a chat template gets the prompt as written, and a
system prompt, which it cannot place, is refused. The prompt as written (`raw_prompt`, or a model
without a template) is the client's whole prompt, as `prompt_token_ids` would be: its special tokens
count, as in vLLM's completions; no turn of the server's is there to forge.

A conversation (`turns`) is rendered whole by the template, after the model's default system turn when it
needs one and the conversation opens with none, with its `tools` offered and its `answer_prefix` after the
generation prompt; a template that would drop the tools or an assistant turn's tool calls is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from omnistage.checkpoints.shards import CheckpointError
from omnistage.contract import conversation
from omnistage.contract.params import InvalidRequest, RequestParams
from stage_service.runtime.chat_tokens import ChatTurn, Checked, ClientText, chat_ids, conversation_ids, places

TEMPLATE_FILE = "chat_template.jinja"
LEGACY_TEMPLATE_FILE = "chat_template.json"  # {"chat_template": "..."}, as older processors save it


def load_chat_template(root: Path, tokenizer) -> str | None:
    """The checkpoint's chat template, where its processor finds it: `chat_template.jinja`, then the
    legacy `chat_template.json`, then the tokenizer's own (tokenizer_config.json); None if it has none."""
    root = Path(root)
    if (root / TEMPLATE_FILE).exists():
        return (root / TEMPLATE_FILE).read_text()
    if (root / LEGACY_TEMPLATE_FILE).exists():
        try:
            return json.loads((root / LEGACY_TEMPLATE_FILE).read_text())["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{root / LEGACY_TEMPLATE_FILE}: no chat_template string") from None
    return tokenizer.chat_template or None


def prompt_ids(p: RequestParams, tokenizer, template: str | None, default_system: str = "") -> list[int]:
    """The token ids a request's prompt becomes under the policy above; `template` is the checkpoint's
    (`load_chat_template`), `default_system` the system turn the model needs when the request has none."""
    if p.prompt_token_ids:
        return list(p.prompt_token_ids)
    if p.turns:
        if template is None:
            raise InvalidRequest("params.turns", "needs the chat template (this model has none)")
        return render_conversation(p, tokenizer, template, default_system,
                                   lambda i, part: ClientText(part.text, f"params.parts[{i}].text"))
    if p.raw_prompt or template is None:
        if p.system_prompt:
            why = "raw_prompt is set" if p.raw_prompt else "this model has no chat template"
            raise InvalidRequest("params.system_prompt", f"needs the chat template ({why})")
        return tokenizer(p.text)["input_ids"]
    return chat_prompt_ids(tokenizer, template, p.text, p.system_prompt or default_system,
                           field="params.parts" if p.parts else "params.prompt")


def chat_prompt_ids(tokenizer, template: str, text: str, system: str = "", field: str = "params.prompt") -> list[int]:
    """An optional system turn and the user turn in `template`, with the assistant generation prompt, as
    token ids: the template's markers special, the texts plain (`chat_tokens.chat_ids`); `field` names
    the request field the user text came from."""
    return chat_ids(tokenizer, template, ClientText(system, "params.system_prompt") if system else None,
                    ClientText(text, field))


def render_conversation(p: RequestParams, tokenizer, template: str, default_system: str,
                        item: Callable[[int, object], ClientText | dict],
                        expand: Callable[[str], str] | None = None) -> list[int]:
    """A request's conversation as token ids: `item(i, part)` gives what parts[i] is to the template (a
    `ClientText`, or a media part's dict); `expand` as `chat_tokens.conversation_ids`."""
    turns: list[ChatTurn] = []
    checked: list[Checked] = []
    messages = conversation.messages(p)
    for m in messages:
        items = [item(i, part) for i, part in m.parts]
        content: ClientText | list | str
        if not items:  # no text (an assistant turn of calls only, an empty result): empty, as the client's is
            content = ""
        elif all(isinstance(x, ClientText) for x in items):  # text only: one string, as a plain message has
            content = ClientText("".join(x.text for x in items), f"{m.field}.parts")
        else:
            content = items
        extra: dict = {}
        if m.tool_calls:
            extra["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                 "arguments": c.arguments}}
                                   for c in m.tool_calls]
            checked += [Checked(c.arguments, f"{m.field}.tool_calls[{j}].arguments")
                        for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            extra["tool_call_id"] = m.tool_call_id
        turns.append(ChatTurn(m.role, content, extra))
    if default_system and turns[0].role != "system":
        turns.insert(0, ChatTurn("system", ClientText(default_system, "params.turns")))
    tools = conversation.tool_dicts(p.tools) if p.tools else None
    # As the templates' `tojson` writes them (non-ASCII as it is), so that a special token in them is found.
    checked += [Checked(json.dumps(t, ensure_ascii=False), f"params.tools[{i}]") for i, t in enumerate(tools or [])]
    offers = bool(tools) or any(m.tool_calls for m in messages)
    tools_placed, calls_placed = places(tokenizer, template, turns, tools) if offers else (True, True)
    if not tools_placed:
        raise InvalidRequest("params.tools", "this model's chat template has no place for tools (it renders the "
                                             "same prompt without them)")
    if not calls_placed:
        raise InvalidRequest("params.turns", "this model's chat template drops an assistant turn's tool calls")
    prefix = ClientText(p.answer_prefix, "params.answer_prefix") if p.answer_prefix else None
    return conversation_ids(tokenizer, template, turns, expand, tools, prefix, tuple(checked))


def check_context(p: RequestParams, n_prompt: int, max_len: int) -> None:
    """A prompt of `n_prompt` tokens and the request's max_tokens within the model's length: a prompt alone
    past it is refused naming the prompt's field (a conversation's: its turns), else max_tokens."""
    if n_prompt >= max_len:
        raise InvalidRequest(p.prompt_field, f"is {n_prompt} tokens; the model's length is {max_len} (the answer "
                                             "needs at least one more): shorten it")
    if n_prompt + p.max_tokens > max_len:
        raise InvalidRequest("params.text.max_tokens", f"prompt ({n_prompt} tokens) plus max_tokens "
                                                       f"({p.max_tokens}) exceeds the model's length {max_len}")
