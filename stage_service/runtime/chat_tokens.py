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


def chat_ids(tokenizer, template: str, system: ClientText | None, user: ClientText | list,
             expand: Callable[[str], str] | None = None) -> list[int]:
    """An optional system turn and the user turn in `template`, with the assistant generation prompt, as
    token ids; the client's texts as plain text. `user` is one text or a list of content parts (a
    `ClientText`, or a media part's dict such as {"type": "audio"}); `expand`, if given, rewrites the
    rendered template before it is tokenized (the processor's placeholder expansion)."""
    texts = [system] if system else []
    texts += [user] if isinstance(user, ClientText) else [p for p in user if isinstance(p, ClientText)]
    open_ = _sentinel_opening(template, texts)
    sentinels = {f"{open_}{i}{SENTINEL_CLOSE}": t for i, t in enumerate(texts)}
    by_text = {id(t): s for s, t in sentinels.items()}

    def render(placed: Callable[[ClientText], str]) -> str:
        content = placed(user) if isinstance(user, ClientText) else [
            {"type": "text", "text": placed(p)} if isinstance(p, ClientText) else p for p in user]
        messages = ([{"role": "system", "content": placed(system)}] if system else []) + \
            [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)

    sentinel = re.compile("|".join(re.escape(s) for s in sentinels)) if sentinels else None

    def unmask(piece: str) -> str:
        return sentinel.sub(lambda m: sentinels[m.group(0)].text, piece) if sentinel else piece

    specials = _specials(tokenizer)
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
