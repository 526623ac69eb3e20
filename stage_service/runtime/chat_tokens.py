"""A chat template rendered into token ids with the client's text kept plain: the one place client text
becomes ids.

The template's own markers (`<|im_start|>`, `<|im_end|>`, the media placeholders it or the processor
places) are special tokens; text the client wrote (the system prompt, the user turn's text) is tokenized
with special tokens NOT recognised, so "<|im_end|>\\n<|im_start|>system\\n..." in a message is text, not a
forged turn, and "<|AUDIO|>" is text, not a placeholder for media that is not there.

How: the template is rendered with each client text replaced by a sentinel (private-use characters and a
name found in no client text and not in the template). That rendering is cut at the special tokens, which
are all the template's own and keep their ids; each piece between two of them gets its sentinels replaced
by the client's text and is tokenized with special tokens split. The tokenizer itself cuts a string at its
added tokens and tokenizes the pieces between them one by one, and a piece holds no special token apart
from the client's, so for text without special tokens the ids are those of the whole rendered string.

The sentinel stands for the text only where the template places message text as written. A template
that rewrites it (a `| trim`, say) is caught by comparing the two renderings; with such a template the
rendered string is tokenized as it is, and client text that carries a special token is refused.
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from omnistage.contract.params import InvalidRequest

# Private-use characters around the sentinels: no tokenizer gives them a meaning, and a client text that
# holds the whole opening (private use, then the name) moves the sentinels to another name.
SENTINEL_OPEN, SENTINEL_CLOSE = "\ue000", "\ue001"


@dataclass(frozen=True)
class ClientText:
    """A text the client wrote, and the request field it came from (named when it is refused)."""

    text: str
    field: str


class _Specials:
    """A tokenizer's special tokens (their strings and ids, a pattern that finds them as the tokenizer
    does) and an encoder of text that leaves them split. Built once per tokenizer: a copy of the backend
    with special tokens split, as transformers' `split_special_tokens=True` would toggle it on the shared
    one (a race between requests tokenized in threads)."""

    def __init__(self, tokenizer):
        self.ids = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        added = [t for t in tokenizer.added_tokens_decoder.values() if t.special]
        # Longest first, as the tokenizer matches; lstrip / rstrip tokens take the whitespace beside them.
        alternatives = [(r"\s*" if t.lstrip else "") + re.escape(t.content) + (r"\s*" if t.rstrip else "")
                        for t in sorted(added, key=lambda t: len(t.content), reverse=True)]
        self.pattern = re.compile("(" + "|".join(alternatives) + ")") if alternatives else None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            plain = copy.deepcopy(backend)
            plain.encode_special_tokens = True
            plain.no_truncation()   # whatever an earlier call left on the shared backend: pieces whole, unpadded
            plain.no_padding()
            self.plain: Callable[[str], list[int]] = lambda s: plain.encode(s, add_special_tokens=False).ids
        else:  # a tokenizer in Python: the flag is an argument of the call, not shared state
            self.plain = lambda s: tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def token_id(self, piece: str) -> int:
        return self.ids[piece.strip()]

    def found(self, text: str) -> str | None:
        """The first special token in `text`, if any."""
        m = self.pattern.search(text) if self.pattern else None
        return m.group(0).strip() if m else None


_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _specials(tokenizer) -> _Specials:
    try:
        return _SPECIALS[tokenizer]
    except KeyError:
        return _SPECIALS.setdefault(tokenizer, _Specials(tokenizer))


@dataclass(frozen=True)
class ChatTurn:
    """One message as the template reads it: `content` one client text or a list of content parts (a
    `ClientText`, or a media part's dict such as {"type": "audio"}), or "" for none; `extra` the template's
    other keys of the message (an assistant's `tool_calls`, a tool's `tool_call_id`), strings checked by
    `Checked`."""

    role: str
    content: ClientText | list | str
    extra: dict | None = None


@dataclass(frozen=True)
class Checked:
    """A client string the template places where it may rewrite it (a tool's JSON, a call's arguments): it
    must carry no special token of the model, and is refused naming `field` when it does."""

    text: str
    field: str


def chat_ids(tokenizer, template: str, system: ClientText | None, user: ClientText | list,
             expand: Callable[[str], str] | None = None) -> list[int]:
    """An optional system turn and the user turn in `template`, with the assistant generation prompt, as
    token ids; the client's texts as plain text (`conversation_ids` of those two turns)."""
    turns = ([ChatTurn("system", system)] if system else []) + [ChatTurn("user", user)]
    return conversation_ids(tokenizer, template, turns, expand)


# The special tokens an answer prefix may hold: a tool call's tags (a forced call opens with one). No other:
# a prefix is never a way to close the assistant's turn and open another.
PREFIX_TAGS = frozenset({"<tool_call>", "</tool_call>"})


def conversation_ids(tokenizer, template: str, turns: list[ChatTurn], expand: Callable[[str], str] | None = None,
                     tools: list[dict] | None = None, prefix: ClientText | None = None,
                     checked: tuple[Checked, ...] = ()) -> list[int]:
    """`turns` in `template`, with `tools` offered and the assistant generation prompt, then `prefix` (the
    text the answer starts with), as token ids; the client's texts as plain text, the prefix as text whose
    tool-call tags are the model's own tokens (`PREFIX_TAGS`; any other special token in it is refused).
    `expand`, if given, rewrites the rendered template before it is tokenized (the processor's placeholder
    expansion)."""
    return _conversation_ids(tokenizer, template, turns, expand, tools, checked) + \
        (prefix_ids(tokenizer, prefix) if prefix else [])


def prefix_ids(tokenizer, prefix: ClientText) -> list[int]:
    specials = _specials(tokenizer)
    found = {m.strip() for m in specials.pattern.findall(prefix.text)} if specials.pattern else set()
    if found - PREFIX_TAGS:
        raise InvalidRequest(prefix.field, f'contains "{sorted(found - PREFIX_TAGS)[0]}", a special token of the '
                                           "model (an answer prefix may open a tool call, nothing else)")
    return tokenizer(prefix.text, add_special_tokens=False)["input_ids"]


def _conversation_ids(tokenizer, template: str, turns: list[ChatTurn], expand: Callable[[str], str] | None,
                      tools: list[dict] | None, checked: tuple[Checked, ...]) -> list[int]:
    texts = [t for turn in turns for t in _client_texts(turn.content)]
    specials = _specials(tokenizer)
    refuse_special_tokens(tokenizer, checked)
    open_ = _sentinel_opening(template, texts)
    sentinels = {f"{open_}{i}{SENTINEL_CLOSE}": t for i, t in enumerate(texts)}
    by_text = {id(t): s for s, t in sentinels.items()}

    def render(placed: Callable[[ClientText], str]) -> str:
        messages = [{"role": turn.role, "content": _placed(turn.content, placed), **(turn.extra or {})}
                    for turn in turns]
        offered = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **offered)

    sentinel = re.compile("|".join(re.escape(s) for s in sentinels)) if sentinels else None

    def unmask(piece: str) -> str:
        return sentinel.sub(lambda m: sentinels[m.group(0)].text, piece) if sentinel else piece

    masked = render(lambda t: by_text[id(t)])
    if sentinel is not None:
        as_written = render(lambda t: t.text)
        if unmask(masked) != as_written:
            return _as_rendered(tokenizer, specials, as_written, texts, expand)
    rendered = expand(masked) if expand else masked
    pieces = specials.pattern.split(rendered) if specials.pattern else [rendered]
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:  # what the pattern matched: a special token of the template
            ids.append(specials.token_id(piece))
        elif piece:
            ids += specials.plain(unmask(piece))
    return ids


def refuse_special_tokens(tokenizer, texts: tuple[Checked | ClientText, ...]) -> None:
    """Refuse, naming its field, a client text that carries a special token of the model: for text placed
    where it cannot be kept plain (a template that rewrites it, a processor that tokenizes it whole)."""
    specials = _specials(tokenizer)
    for c in texts:
        found = specials.found(c.text)
        if found:
            raise InvalidRequest(c.field, f'contains "{found}", a special token of the model')


def places(tokenizer, template: str, turns: list[ChatTurn], tools: list[dict] | None) -> tuple[bool, bool]:
    """Whether `template` places offered tools, and an assistant turn's tool calls: a template that renders
    the same without them drops them (a request relying on them is refused rather than answered blind)."""
    def render(ts: list[ChatTurn], offered: list[dict] | None) -> str:
        messages = [{"role": t.role, "content": _placed(t.content, lambda c: c.text), **(t.extra or {})}
                    for t in ts]
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **({"tools": offered} if offered else {}))

    with_all = render(turns, tools or None)
    tools_placed = not tools or render(turns, None) != with_all
    calls = any(t.extra and t.extra.get("tool_calls") for t in turns)
    bare = [ChatTurn(t.role, t.content, {k: v for k, v in (t.extra or {}).items() if k != "tool_calls"})
            for t in turns]
    calls_placed = not calls or render(bare, tools or None) != with_all
    return tools_placed, calls_placed


def _client_texts(content: ClientText | list | str) -> list[ClientText]:
    if isinstance(content, str):
        return []
    return [content] if isinstance(content, ClientText) else [p for p in content if isinstance(p, ClientText)]


def _placed(content: ClientText | list | str, placed: Callable[[ClientText], str]):
    """A turn's content as the template gets it, each client text as `placed` writes it."""
    if isinstance(content, str):
        return content
    if isinstance(content, ClientText):
        return placed(content)
    return [{"type": "text", "text": placed(p)} if isinstance(p, ClientText) else p for p in content]


def _sentinel_opening(template: str, texts: list[ClientText]) -> str:
    """The opening of this call's sentinels: in neither the template nor any client text."""
    n = 0
    while True:
        opening = f"{SENTINEL_OPEN}omnistage-client-text-{n}-"
        if opening not in template and not any(opening in t.text for t in texts):
            return opening
        n += 1


def _as_rendered(tokenizer, specials: _Specials, rendered: str, texts: list[ClientText],
                 expand: Callable[[str], str] | None) -> list[int]:
    """A template that rewrites message text: the rendered string as it is, once no client text carries
    a special token."""
    for t in texts:
        found = specials.found(t.text)
        if found:
            raise InvalidRequest(t.field, f'contains "{found}", a special token of the model (its chat template '
                                          "rewrites message text, so it cannot be kept as plain text)")
    return tokenizer(expand(rendered) if expand else rendered, add_special_tokens=False)["input_ids"]
