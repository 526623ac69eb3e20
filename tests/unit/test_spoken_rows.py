"""With tools in play the Talker speaks the answer's other text, never its tool calls: the Thinker marks the
rows of a call unspoken (stage_service/engines/omni/spoken.py) and the Talker's feed leaves them out
(stage_service/engines/omni/talker.py ThinkerFeed)."""

from __future__ import annotations

import asyncio

import torch

from stage_service.engines.omni.spoken import SpokenRows, tool_tag_ids
from stage_service.engines.omni.talker import ThinkerFeed
from stage_service.runtime.base import InputChunk

OPEN, CLOSE = 7, 8
PROMPT = [1, 2, OPEN, 9, CLOSE, 3]   # the system turn's example call: closed, so the answer starts outside


def marks(prompt: list[int], generated: list[int], split: list[int]) -> list[bool]:
    rows = SpokenRows((OPEN, CLOSE), prompt)
    out: list[bool] = []
    fed = 0
    for n in split:   # rows arrive in chunks; the token a row stands for was sampled before it
        out += rows.marks(n, generated[:max(0, fed + n - len(prompt))]).tolist()
        fed += n
    return out


def test_the_rows_of_a_call_tags_included_are_unspoken_however_chunked():
    generated = [20, 21, OPEN, 30, 31, CLOSE, 22]
    want = [True] * len(PROMPT) + [True, True, False, False, False, False, True]
    for split in ([len(PROMPT) + len(generated)], [len(PROMPT), 1, 1, 1, 1, 1, 1, 1], [3, 4, 2, 4]):
        assert marks(PROMPT, generated, split) == want


def test_an_answer_prefix_that_opens_a_call_starts_the_answer_inside_it():
    forced = [*PROMPT, OPEN, 40]       # the prompt ends in the forced call's opening
    assert marks(forced, [41, 42, CLOSE, 23], [len(forced) + 4]) == [True] * len(forced) + [False] * 3 + [True]


def test_the_tiny_qwen_tokenizer_has_the_tags(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir / "qwen3-omni-tiny")
    assert tool_tag_ids(tok) == (tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("</tool_call>"))


def chunk(i: int, rows: int, spoken: list[bool] | None, prompt: list[int] | None = None) -> InputChunk:
    tensors = {"embeds": torch.arange(rows, dtype=torch.float32)[:, None] + 100 * i,
               "hidden": torch.zeros(rows, 1)}
    if spoken is not None:
        tensors["spoken"] = torch.tensor(spoken)
    if prompt is not None:
        tensors["prompt_token_ids"] = torch.tensor(prompt)
    return InputChunk("thinker", i, tensors)


def test_the_talkers_feed_leaves_the_unspoken_rows_out():
    class Inputs:
        def __init__(self, chunks):
            self.chunks = list(chunks)

        async def next(self):
            return self.chunks.pop(0) if self.chunks else None

    first = chunk(0, 5, [True, True, True, False, True], prompt=[1, 2, 3])
    ids, embeds, _ = asyncio.run(ThinkerFeed().read_prompt(Inputs([first])))
    assert ids == [1, 2, 3] and embeds[:, 0].tolist() == [0, 1, 2, 4]   # row 3 (a call's) left out
    later, _ = ThinkerFeed.spoken_rows_of(chunk(1, 3, [False, True, False]))
    assert later[:, 0].tolist() == [101]
    unmarked, _ = ThinkerFeed.spoken_rows_of(chunk(2, 2, None))   # a Thinker that marks nothing: all spoken
    assert unmarked[:, 0].tolist() == [200, 201]


def test_an_answer_that_opens_with_a_call_is_read_past_the_call_to_its_first_spoken_row():
    class Inputs:
        def __init__(self, chunks):
            self.chunks = list(chunks)

        async def next(self):
            return self.chunks.pop(0) if self.chunks else None

    chunks = [chunk(0, 4, [True, True, True, False], prompt=[1, 2, 3]), chunk(1, 2, [False, True])]
    ids, embeds, _ = asyncio.run(ThinkerFeed().read_prompt(Inputs(chunks)))
    assert embeds[:, 0].tolist() == [0, 1, 2, 101]   # the prompt, then the first row spoken after the call
