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
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.checkpoints.shards import CheckpointError
from omnistage.contract.params import InvalidRequest, RequestParams
from stage_service.runtime.chat_tokens import ClientText, chat_ids

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
