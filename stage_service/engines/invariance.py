"""Batch invariance: a request gets the same numbers alone as in any batch.

Measured on the CPU builds here (MKL, AVX2 and AVX-512): a matmul with fewer than 4 rows (16 on AVX-512), a
2-D convolution over a batch of 1, and a matmul or group norm over a strided
input that is strided only for some batch sizes take other kernels than the
general case and round differently (last bits), which is enough to flip a
sampled token or a pixel. These
helpers pad such calls up to the size where every batch shares one kernel, so a
row's result never depends on its neighbours. MoE experts run as one small
matmul per (token, expert) pair ("batched_mm"), which is invariant too.

The cost is the padding itself: tiny for matmuls; for a convolution it doubles
the work of a lone single-sample call. Engines take `engineArgs.batch_invariant:
false` to skip all of it.

Per device (`applies_on`, by the stage's placement): on the CPU, as measured.
On CUDA it is kept too: cuBLAS and cuDNN also choose kernels by shape, the
padding costs little there, and no GPU has yet run the batched-vs-alone tests
that would show it can go (or that CUDA needs more than padding).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from omnistage.devices import DevicePlan

def _min_matmul_rows() -> int:
    """Rows from which every matmul on this CPU takes one kernel: 4 measured on AVX2; on AVX-512 the
    small-matrix path reaches further, with the inner dimension (up to 15 rows below a 512-wide one,
    measured on torch 2.13's CPU build), so 16 there."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 4


MIN_MATMUL_ROWS = _min_matmul_rows()
MIN_CONV_BATCH = 2
MOE_EXPERTS = "batched_mm"
PADDED_DEVICES = frozenset({"cpu", "cuda"})  # where the padding applies: see the module docstring


def applies_on(plan: DevicePlan) -> bool:
    """Whether an engine placed by `plan` pads for batch invariance (when its engineArgs ask for it)."""
    return plan.device in PADDED_DEVICES


def _linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Contiguous first: a strided view folds into one matmul for a batch of 1 but not for more.
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows >= MIN_MATMUL_ROWS:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(MIN_MATMUL_ROWS - rows, flat.shape[1])])
    return F.linear(flat, self.weight, self.bias)[:rows].reshape(*x.shape[:-1], -1)


def _group_norm(self: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    return F.group_norm(x.contiguous(), self.num_groups, self.weight, self.bias, self.eps)


def _conv2d(self: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    if x.dim() != 4 or x.shape[0] >= MIN_CONV_BATCH:
        return self._conv_forward(x, self.weight, self.bias)
    padded = torch.cat([x, x.new_zeros(MIN_CONV_BATCH - x.shape[0], *x.shape[1:])])
    return self._conv_forward(padded, self.weight, self.bias)[: x.shape[0]]


def make_batch_invariant(model: torch.nn.Module) -> torch.nn.Module:
    """Pad every small Linear and Conv2d call of `model` and make their (and GroupNorm's) inputs
    contiguous, in place; returns the model."""
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = types.MethodType(_linear, m)
        elif type(m) is torch.nn.Conv2d and m.padding_mode == "zeros":
            m.forward = types.MethodType(_conv2d, m)
        elif type(m) is torch.nn.GroupNorm:
            m.forward = types.MethodType(_group_norm, m)
    return model


def pad_rows(x: torch.Tensor, rows: int = MIN_MATMUL_ROWS) -> torch.Tensor:
    """`x` [n, ...] with zero rows added up to `rows` (for inputs this code batches itself)."""
    if len(x) >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - len(x), *x.shape[1:])])
