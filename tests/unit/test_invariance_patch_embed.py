"""make_batch_invariant and 3-D patch embeddings: the matmul form of a Conv3d that cuts patches is the Wan
denoiser's alone (asked for with patch_embed_3d=True); other models' (the Qwen omni vision towers') are left as
torch runs them, so their outputs stay those of transformers."""

from __future__ import annotations

import torch

from stage_service.runtime.invariance import make_batch_invariant


def vision_patch_embed() -> torch.nn.Sequential:
    """A Qwen omni vision tower's patch embedding: 2 frames x 14 x 14 pixel patches, kernel = stride, no bias."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv3d(3, 32, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False))


def test_a_conv3d_patch_embed_is_left_as_torch_runs_it_by_default():
    model = vision_patch_embed()
    conv = model[0]
    x = torch.randn(5, 3, 2, 14, 14)
    with torch.no_grad():
        expected = torch.nn.functional.conv3d(x, conv.weight, None, conv.stride)
        make_batch_invariant(model)
        assert "forward" not in vars(conv)  # its own nn.Conv3d forward, not the matmul
        assert torch.equal(model(x), expected)


def test_the_wan_denoiser_asks_for_its_patch_embed_as_a_padded_matmul():
    model = vision_patch_embed()
    conv = model[0]
    x = torch.randn(1, 3, 4, 28, 28)
    with torch.no_grad():
        expected = torch.nn.functional.conv3d(x, conv.weight, None, conv.stride)
        make_batch_invariant(model, patch_embed_3d=True)
        assert "forward" in vars(conv)  # the matmul over patches
        out = model(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
