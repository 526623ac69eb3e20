"""Which of the Thinker's rows the Talker speaks when the answer may call tools (pure).

An answer's tool calls (`<tool_call>...</tool_call>`, Qwen's tool format) are for the client's code, not for
the listener: the Thinker marks each row it sends beyond the prompt `spoken` (a bool per row) and the Talker
leaves out the rows of a call, tags included, so the audio says the answer's other text only. A call the
answer opens in its prefix (a forced call: the prompt's assistant turn ends inside `<tool_call>`) starts the
answer inside a call. Prompt rows are always kept: the Talker reads the conversation from them.

Rows follow the positions the Thinker feeds: the prompt's ids, then each generated token (fed the step after
it was sampled), so row k stands for `ids[k]`, or the (k - len(ids))-th generated token.
"""

from __future__ import annotations

import torch

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_tag_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of the call tags in `tokenizer`'s vocabulary (one token each, as Qwen's tokenizers have them);
    None when it has no such tokens."""
    vocab = tokenizer.get_vocab()
    if OPEN in vocab and CLOSE in vocab:
        return vocab[OPEN], vocab[CLOSE]
    return None


class SpokenRows:
    def __init__(self, tags: tuple[int, int], prompt_ids: list[int]):
        self.open, self.close = tags
        self.prompt = len(prompt_ids)
        self.fed = 0  # rows marked so far
        # Inside a call when the prompt's last tag opens one (an answer prefix that forces a call).
        tags_in_prompt = [t for t in prompt_ids if t in tags]
        self.in_call = bool(tags_in_prompt) and tags_in_prompt[-1] == self.open

    def marks(self, rows: int, generated: list[int]) -> torch.Tensor:
        """The `spoken` mask of the next `rows` rows (`generated`: every token sampled so far)."""
        out = []
        for k in range(self.fed, self.fed + rows):
            if k < self.prompt:
                out.append(True)
                continue
            token = generated[k - self.prompt]
            if token == self.open:
                self.in_call = True
            out.append(not self.in_call)
            if token == self.close:
                self.in_call = False
        self.fed += rows
        return torch.tensor(out, dtype=torch.bool)
