"""A digest of an output chunk's content, so a chunk repeated by another replica after a retry can be
checked against the one already handed on (equal content gives equal digests on any replica)."""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

DIGEST_BYTES = 16  # BLAKE2b-128: a collision between two generations that differ is not a practical concern


def chunk_digest(tensors: Mapping[str, torch.Tensor], text: str) -> bytes:
    """The digest of a chunk: its text, then each tensor by name with its dtype, shape and values. A tensor
    on the host is hashed byte for byte; one on an accelerator by a checksum reduced where it lives (its sum,
    sum of squares and position-weighted sum in float64): copying every chunk to the host to hash it would
    cost the transfer the data plane avoids, and a diverged generation changes all three."""
    h = hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES)
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        flat = t.contiguous().reshape(-1)
        if flat.device.type == "cpu":
            h.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            x = flat.to(torch.float64)
            weights = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.float64)
            h.update(torch.stack([x.sum(), (x * x).sum(), (x * weights).sum()]).cpu().numpy().tobytes())
    return h.digest()
