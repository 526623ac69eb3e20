"""Batch invariance: a request gets the same numbers alone as in any batch.

Measured on the CPU builds here (MKL, AVX2 and AVX-512): a matmul with fewer than 4 rows (16 on AVX-512), a
2-D convolution over a batch of 1, and a matmul or group norm over a strided
input that is strided only for some batch sizes take other kernels than the
general case and round differently (last bits), which is enough to flip a
sampled token or a pixel. These
helpers pad such calls up to the size where every batch shares one kernel, so a
row's result never depends on its neighbours. MoE experts run as one small
matmul per (token, expert) pair ("batched_mm"), which is invariant too.

On the CPU, convolutions run channels-last (the weights converted once, every
input made channels-last), and so do group norms with one thread (with more, the
channels-last group norm splits odd batches differently; contiguous it does not).
Measured here with one thread, a contiguous 1x1
convolution rounds differently below a batch of 16 than from 16 (torch's own
kernel, then oneDNN's: 1 ulp) where the channels-last 3x3 kernels agree for every
batch of 2-16, and they are 6-15% faster on the tiny VAE's decode (its own speed
without any of this). A 1x1 convolution is a matmul over the channels and runs as
one, padded like any matmul; a grouped 1x1 one pads its batch to 16.

The cost is the padding itself: tiny for matmuls; for a 3x3 convolution it doubles
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
import torch.nn.functional as F  # noqa: N812 - the ecosystem's name for it

from omnistage.contract.devices import DevicePlan


def _min_matmul_rows() -> int:
    """Rows from which every matmul on this CPU takes one kernel: 4 measured on AVX2; on AVX-512 the
    small-matrix path reaches further, with the inner dimension (up to 15 rows below a 512-wide one,
    measured on torch 2.13's CPU build), so 16 there."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 4


MIN_MATMUL_ROWS = _min_matmul_rows()
MIN_CONV_BATCH = 2
ONE_BY_ONE_CONV_BATCH = 16  # a 1x1 convolution that is not a plain matmul (grouped): see _least_batch
MOE_EXPERTS = "batched_mm"
PADDED_DEVICES = frozenset({"cpu", "cuda"})  # where the padding applies: see the module docstring


def applies_on(plan: DevicePlan) -> bool:
    """Whether an engine placed by `plan` pads for batch invariance (when its engineArgs ask for it)."""
    return plan.device in PADDED_DEVICES


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # Contiguous first: a strided view folds into one matmul for a batch of 1 but not for more.
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows >= MIN_MATMUL_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(MIN_MATMUL_ROWS - rows, flat.shape[1])])
    return F.linear(flat, weight, bias)[:rows].reshape(*x.shape[:-1], -1)


def _linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _matmul(x, self.weight, self.bias)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """Channels-last on the CPU, where it is measured; contiguous elsewhere (as before, until a GPU run)."""
    cpu_4d = x.dim() == 4 and x.device.type == "cpu"
    return x.contiguous(memory_format=torch.channels_last) if cpu_4d else x.contiguous()


def _group_norm(self: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    # Channels-last only with one thread: with more, its kernel splits an odd batch differently (measured:
    # batches 1, 3, 5, ... against 16 with two threads), where the contiguous one agrees.
    x = _channels_last(x) if torch.get_num_threads() == 1 else x.contiguous()
    return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def _one_by_one(conv: torch.nn.Conv2d) -> bool:
    return conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.dilation == (1, 1)


def _pointwise(conv: torch.nn.Conv2d) -> bool:
    """A 1x1 convolution that is a plain matmul over the channels ("same" padding is none for 1x1)."""
    return _one_by_one(conv) and conv.groups == 1 and conv.padding in ((0, 0), "valid", "same")


def _least_batch(conv: torch.nn.Conv2d) -> int:
    """The batch from which every call of `conv` takes one kernel. With one thread torch runs an unstrided
    1x1 convolution below a batch of 16 on its own kernel and from 16 on oneDNN's (measured: a grouped
    one rounds differently at every batch of 1-15); a plain 1x1 never gets here (a matmul)."""
    return ONE_BY_ONE_CONV_BATCH if _one_by_one(conv) else MIN_CONV_BATCH


def _conv2d(self: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 4:
        return self._conv_forward(x.contiguous(), self.weight, self.bias)
    x = _channels_last(x)
    if _pointwise(self):  # channels-last [n, c, h, w] is [n, h, w, c] in memory: no copy either way
        rows = _matmul(x.permute(0, 2, 3, 1), self.weight.reshape(self.out_channels, -1), self.bias)
        return rows.permute(0, 3, 1, 2)
    least = _least_batch(self)
    if x.shape[0] >= least:
        return self._conv_forward(x, self.weight, self.bias)
    padded = _channels_last(torch.cat([x, x.new_zeros(least - x.shape[0], *x.shape[1:])]))
    return self._conv_forward(padded, self.weight, self.bias)[: x.shape[0]]


def _patchifies(conv: torch.nn.Conv3d) -> bool:
    """A 3-D convolution that cuts its input into disjoint patches (kernel = stride, no padding, no groups):
    a video DiT's patch embedding (Wan's), a plain matmul over each patch's values."""
    return (conv.kernel_size == conv.stride and conv.groups == 1 and conv.dilation == (1, 1, 1)
            and conv.padding in ((0, 0, 0), "valid"))


def _patch_conv3d(self: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """The patch embedding as a matmul over patches: torch's 3-D convolution kernel rounds a batch of one
    differently from a larger batch (measured on Wan's patch embedding: last bits), a padded matmul does not."""
    if x.dim() != 5 or any(s % k for s, k in zip(x.shape[2:], self.kernel_size)):
        return self._conv_forward(x, self.weight, self.bias)
    (n, c, *sides), (kt, kh, kw) = x.shape, self.kernel_size
    t, h, w = sides[0] // kt, sides[1] // kh, sides[2] // kw
    patches = x.reshape(n, c, t, kt, h, kh, w, kw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(n, t, h, w, -1)
    rows = _matmul(patches, self.weight.reshape(self.out_channels, -1), self.bias)
    return rows.permute(0, 4, 1, 2, 3)


def make_batch_invariant(model: torch.nn.Module, patch_embed_3d: bool = False) -> torch.nn.Module:
    """Pad every small Linear and Conv2d call of `model` and make their inputs contiguous (channels-last
    for convolutions and group norms; the convolutions' weights are converted here), in place; returns the
    model. `patch_embed_3d`: also run a video DiT's patch embedding (a Conv3d cutting patches) as a padded
    matmul (the Wan denoiser asks for it); off, a Conv3d is left as torch runs it (the Qwen omni vision
    towers' patch embeddings: their outputs stay those of transformers). Convolutions and group
    norms then return channels-last tensors, as torch does for channels-last input: code that needs
    contiguous memory (`.view(n, -1)`, safetensors) calls `.contiguous()` first."""
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = types.MethodType(_linear, m)
        elif patch_embed_3d and type(m) is torch.nn.Conv3d and m.padding_mode == "zeros" and _patchifies(m):
            m.forward = types.MethodType(_patch_conv3d, m)
        elif type(m) is torch.nn.Conv2d and m.padding_mode == "zeros":
            if m.weight.device.type == "cpu":
                m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last)
            m.forward = types.MethodType(_conv2d, m)
        elif type(m) is torch.nn.GroupNorm:
            m.forward = types.MethodType(_group_norm, m)
    return model


def _conv_forward_padded(self: torch.nn.Conv2d | torch.nn.Conv3d, x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    conv = type(self)._conv_forward
    if x.shape[0] >= MIN_CONV_BATCH:
        return conv(self, x, weight, bias)  # type: ignore[arg-type]
    return conv(self, pad_rows(x, MIN_CONV_BATCH), weight, bias)[: x.shape[0]]  # type: ignore[arg-type]


def pad_lone_convolutions(model: torch.nn.Module) -> torch.nn.Module:
    """Run every 2-D and 3-D convolution of `model` over a batch of at least 2 (a lone sample gets a zero
    one beside it), in place (below each layer's own padding, so causal 3-D convolutions keep theirs);
    returns the model. For a video VAE decoded by latent frames (video_vae.py): with one thread, torch
    runs a batch of one on its own kernel for small inputs and on oneDNN's for large ones, and every batch
    from 2 on oneDNN's, which gives each sample the same numbers at every batch size from 2 and position
    (measured on the tiny Wan VAE's decode: batches 2, 3, 4, 5 and 8, other neighbours, other positions).
    oneDNN's kernels are also faster than torch's own there: a lone decode padded to 2 took 0.43x the CPU
    time of one unpadded (128x128, 9 latent frames), where with oneDNN off torch's own kernels gained
    nothing from a batch (4 requests at once: 1.07x the CPU time of one after another)."""
    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)):
            m._conv_forward = types.MethodType(_conv_forward_padded, m)  # type: ignore[method-assign]
    return model


def pad_lone_calls(module: torch.nn.Module, rows: int = MIN_CONV_BATCH) -> torch.nn.Module:
    """Run `module` (one tensor in, one out, each sample on its own) over a batch of at least `rows`, a lone
    sample with zero ones beside it, in place; returns it. For the attention inside a video VAE's decoder
    (video_vae.py): torch's CPU attention gives a batch of one other last bits than a sample in a batch of
    two or more (measured on the tiny Wan VAE's mid-block attention, where a one-level flip of an 8-bit
    frame followed)."""
    forward = module.forward

    def padded(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.shape[0] >= rows:
            return forward(x, *args, **kwargs)
        return forward(pad_rows(x, rows), *args, **kwargs)[: x.shape[0]]

    module.forward = padded  # type: ignore[method-assign]
    return module


def pad_rows(x: torch.Tensor, rows: int = MIN_MATMUL_ROWS) -> torch.Tensor:
    """`x` [n, ...] with zero rows added up to `rows` (for inputs this code batches itself)."""
    if len(x) >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - len(x), *x.shape[1:])])
