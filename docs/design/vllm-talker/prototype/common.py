import torch
IM_START, IM_END, USER, ASSISTANT, NL = 151644, 151645, 872, 77091, 198
H = 64

def request(seed: int, text_rows: int | None = None, user_tokens: int | None = None):
    """A Thinker output as the Talker sees it: prompt ids and random embedding / hidden rows
    [P + 1 + text_rows, H] (P prompt positions, the first generated token, the rows after it)."""
    g = torch.Generator().manual_seed(seed)
    text_rows = 6 + seed % 11 if text_rows is None else text_rows
    user_tokens = 2 + (seed * 3) % 9 if user_tokens is None else user_tokens
    ids = [IM_START, USER, NL] + [100 + seed * 7 + i for i in range(user_tokens)] + [IM_END, NL, IM_START, ASSISTANT, NL]
    n = len(ids) + 1 + text_rows
    embeds = torch.randn(n, H, generator=g) * 0.5
    hidden = torch.randn(n, H, generator=g) * 0.5
    return ids, embeds, hidden
