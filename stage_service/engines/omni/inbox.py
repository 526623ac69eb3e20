"""A Talker state's inbox of Thinker rows: when it has ended, whether the next step's row is in, and how many rows
its next step feeds. Shared by the in-process Talker (`talker.py`) and its engine core in a child process
(`talker_core.py`)."""

from __future__ import annotations

from collections import deque

END_OF_TEXT = None  # in an inbox: the Thinker's stream has ended


def inbox_ended(inbox: deque) -> bool:
    """The end of the Thinker's stream is in the inbox (compared by identity: the rest are tensors)."""
    return any(x is END_OF_TEXT for x in list(inbox))


def speaks_next(steps: int, taken: int, inbox: deque, text_done: bool) -> bool:
    """Whether a Talker state's next step can run: it is the first, the text ended, or the text row it
    speaks is in (`taken` rows already moved out of the inbox, plus those waiting in it)."""
    if steps == 0 or text_done or inbox_ended(inbox):
        return True
    arrived = sum(len(x) for x in list(inbox) if x is not END_OF_TEXT)
    return steps - 1 < taken + arrived


def step_rows(steps: int, prompt_rows: int, recompute: bool) -> int:
    """Rows a Talker's next step feeds: its prompt rows (at most `prompt_rows`) first, every row fed so far and
    the next after a preemption (`recompute`), else one."""
    return prompt_rows if steps == 0 else prompt_rows + steps if recompute else 1
