"""What the step cache's tests and its benchmark (bench/step_cache.py) both read off a denoise stage: the rows its
DiT's second block ran, the pixels a vae-decode stage made, and how far two images are apart (PSNR)."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from .harness import tensor_of


def step_cache(threshold: float, stage: str = "denoise", **more):
    """A pipeline edit: the stage's engineArgs turn the step cache on."""
    def edit(doc):
        doc["spec"]["deployment"]["stages"][stage].setdefault("engineArgs", {}).update(
            step_cache_threshold=threshold, **more)
    return edit


class SecondBlockRows:
    """Rows a denoise stage's DiT ran through its second block (a forward hook): without the cache, every row of
    every step; with it, those of the steps computed in full."""

    def __init__(self, srv):
        model = srv.engine.model
        blocks = getattr(model, "transformer_blocks", None) or model.blocks
        self.rows = 0
        self.hook = blocks[1].register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs) -> None:
        self.rows += (args[0] if args else kwargs["hidden_states"]).shape[0]


def pixels(chunks, output: str) -> np.ndarray:
    """A vae-decode stage's answer as RGB pixels (float64): its PNG (`image`), or all its frames (`video`)."""
    if output == "video":
        return np.concatenate([tensor_of(c, "video").numpy() for c in chunks]).astype(np.float64)
    png = tensor_of(chunks[0], "image").numpy().tobytes()
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


def psnr_db(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of 8-bit pixels (inf when equal)."""
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)
