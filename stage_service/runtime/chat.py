"""Which token ids a request's text prompt becomes: the one prompt policy of every text-in engine.

The prompt is the request's text: `prompt`, or its text parts and then `prompt` (`RequestParams.text`).
`prompt_token_ids` are taken as given; `raw_prompt` tokenizes the prompt as written (with the special
tokens the tokenizer adds to any text, as vLLM and transformers' pipelines do); otherwise the prompt is
the user turn of the checkpoint's chat template, after a system turn (the request's `system_prompt`, or
the model's default where it needs one), with the assistant generation prompt, rendered and tokenized
as the model's processor does it. A model without a chat template gets the prompt as written, and a
system prompt, which it cannot place, is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.checkpoints.shards import CheckpointError
from omnistage.contract.params import InvalidRequest, RequestParams

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


def chat_prompt_ids(tokenizer, template: str, text: str, system: str = "") -> list[int]:
    """An optional system turn and the user turn in `template`, with the assistant generation prompt,
    rendered and then tokenized as the processor does it (the rendered text carries its own special
    tokens, so the tokenizer adds none)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


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
    return chat_prompt_ids(tokenizer, template, p.text, p.system_prompt or default_system)
