"""Batch invariance helpers and packed attention: a row's numbers do not depend on its batch, and
packed steps compute what transformers' own cached forward computes. Plain torch modules and a
tiny random decoder built in memory: no files."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import stage_service.runtime.packed as packed_module
from stage_service.runtime.invariance import MIN_MATMUL_ROWS, make_batch_invariant, pad_rows
from stage_service.runtime.packed import SequenceKV, _KvBlock, packed_forward, padded_sdpa, use_packed_attention


def seeded(n: int, *shape) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_a_linear_row_is_the_same_alone_and_in_a_batch(rows):
    lin = make_batch_invariant(torch.nn.Sequential(torch.nn.Linear(48, 96)))[0]
    x = seeded(32, 48)
    with torch.no_grad():
        full = lin(x)
        assert torch.equal(lin(x[:rows]), full[:rows])
        assert torch.equal(lin(x[:rows].T.contiguous().T), full[:rows])  # a strided view too
        assert torch.equal(lin(x[None, :rows]), full[None, :rows])


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Torch's kernel choice for a convolution depends on its thread count (stages run one thread): both."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("batch", [1, 2, 3, 15])
def test_conv_and_group_norm_rows_are_the_same_alone_and_in_a_batch(threads, batch):
    net = make_batch_invariant(torch.nn.Sequential(torch.nn.Conv2d(8, 32, 3, padding=1), torch.nn.GroupNorm(8, 32)))
    x = seeded(16, 8, 32, 32)
    with torch.no_grad():
        full = net(x)
        assert torch.equal(net(x[:batch]), full[:batch])
        channels_last = x[:batch].to(memory_format=torch.channels_last)
        assert torch.equal(net(channels_last), full[:batch])


@pytest.mark.parametrize("batch", [1, 2, 3, 15])
@pytest.mark.parametrize("size", [1, 12])  # 1x1: fewer rows than a matmul's kernel threshold, padded
@pytest.mark.parametrize("kind", [{}, {"padding": "same"}, {"padding": 1}, {"groups": 4}])
def test_a_pointwise_conv_is_the_same_alone_and_in_a_batch(threads, batch, size, kind):
    conv = torch.nn.Conv2d(8, 16, 1, **kind)
    plain = copy.deepcopy(conv)
    make_batch_invariant(torch.nn.Sequential(conv))
    x = seeded(16, 8, size, size)
    with torch.no_grad():
        full = conv(x)
        torch.testing.assert_close(full, plain(x))
        assert full.shape == plain(x).shape
        assert torch.equal(conv(x[:batch]), full[:batch])
        assert torch.equal(conv(x[:batch].to(memory_format=torch.channels_last)), full[:batch])


def test_a_vae_decode_is_the_same_for_every_batch_and_close_to_the_plain_model(threads):
    """The tiny VAE's decode (the bench's and the examples' shape), random weights: every image the same
    in every batch of 1-16, and within float rounding of the model without the helpers."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(16, 32), norm_num_groups=8, layers_per_block=1, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2).eval()
    plain = copy.deepcopy(vae)
    make_batch_invariant(vae)
    latents = seeded(16, 4, 16, 16)
    with torch.inference_mode():
        full = vae.decode(latents).sample
        torch.testing.assert_close(full, plain.decode(latents).sample, rtol=1e-4, atol=1e-5)
        for batch in range(1, 16):
            assert torch.equal(vae.decode(latents[:batch]).sample, full[:batch]), batch
            assert torch.equal(vae.decode(latents[16 - batch:]).sample, full[16 - batch:]), batch


def test_pad_rows():
    x = torch.ones(2, 3)
    assert pad_rows(x).shape == (MIN_MATMUL_ROWS, 3) and pad_rows(x)[2:].abs().sum() == 0
    assert pad_rows(torch.ones(MIN_MATMUL_ROWS + 1, 3)).shape == (MIN_MATMUL_ROWS + 1, 3)
    assert pad_rows(x, 4).shape == (4, 3)


def test_padded_matmuls_are_row_invariant_on_this_cpu():
    """The reason for MIN_MATMUL_ROWS, measured here: from that many rows up, a row's result does not depend
    on how many rows share the call (the inner sizes of the models' layers, up to 1024)."""
    g = torch.Generator().manual_seed(0)
    for k in (32, 128, 320, 1024):
        w, x = torch.randn(64, k, generator=g), torch.randn(300, k, generator=g)
        ref = torch.nn.functional.linear(x, w)[:1]
        for n in (MIN_MATMUL_ROWS, MIN_MATMUL_ROWS + 1, 31, 64, 300):
            assert torch.equal(torch.nn.functional.linear(x[:n], w)[:1], ref), (k, n)


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    reference = Qwen2ForCausalLM(cfg).eval()
    packed = Qwen2ForCausalLM(copy.deepcopy(cfg)).eval()  # its own config: the attention choice lives there
    packed.load_state_dict(reference.state_dict())
    use_packed_attention(packed.get_decoder())
    make_batch_invariant(packed)
    return reference, packed


def run_packed(model, prompts: list[list[int]], steps: int | list[int], join_at: list[int] | None = None,
               pad_to: int | None = None):
    """Greedy decode; sequence i joins at step join_at[i] and takes steps[i] steps. Returns each sequence's
    last-position logits per step."""
    join_at = join_at or [0] * len(prompts)
    steps = steps if isinstance(steps, list) else [steps] * len(prompts)
    caches = [SequenceKV() for _ in prompts]
    fed: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.inference_mode():
        for step in range(max(j + n for j, n in zip(join_at, steps))):
            live = [i for i in range(len(prompts)) if join_at[i] <= step < join_at[i] + steps[i]]
            inputs = [torch.tensor(fed[i][-1:] if fed[i] else prompts[i]) for i in live]
            last, _ = packed_forward(model.get_decoder(), inputs, [caches[i] for i in live],
                                     embed=model.get_input_embeddings(), pad_to=pad_to)
            out = model.get_output_embeddings()(last)
            for row, i in zip(out, live):
                logits[i].append(row.clone())
                fed[i].append(int(row.argmax()))
    return logits, fed


def test_packed_steps_compute_what_the_cached_forward_computes(tiny_lm):
    reference, packed = tiny_lm
    prompt = [3, 14, 15, 9, 2, 6]
    logits, fed = run_packed(packed, [prompt], steps=5)
    cache = DynamicCache(config=reference.config)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for k in range(5):
            ref = reference(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(logits[0][k], ref, rtol=1e-5, atol=1e-5)
            ids = torch.tensor([[int(ref.argmax())]])
            assert fed[0][k] == int(ref.argmax())


def test_a_sequence_joining_a_running_batch_gets_the_numbers_it_gets_alone(tiny_lm):
    _, packed = tiny_lm
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    alone = [run_packed(packed, [p], steps=6)[0][0] for p in prompts]
    together, _ = run_packed(packed, prompts, steps=6, join_at=[0, 2, 3, 3])
    for a, t in zip(alone, together):
        assert all(torch.equal(x, y) for x, y in zip(a, t))


def test_sequences_of_equal_shape_share_an_attention_call_and_get_their_numbers_alone(tiny_lm, monkeypatch):
    """Sequences with as many cached rows decode in one SDPA call per layer (a `_Group` over one `_KvBlock`),
    bit for bit what each computes alone: three that join together, one that catches up with them (its
    rows move into their block) and one of them leaving early (the others move into a new block)."""
    _, packed = tiny_lm
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10], [11, 12, 13]]
    join_at, steps = [0, 1, 0, 0], [6, 6, 3, 6]  # the second has as many rows as the others from step 2
    alone = [run_packed(packed, [p], steps=[n])[0][0] for p, n in zip(prompts, steps)]
    calls = []
    monkeypatch.setattr(packed_module, "sdpa_attention_forward",
                        lambda *a, **k: calls.append(1) or sdpa_attention_forward(*a, **k))
    together, _ = run_packed(packed, prompts, steps=steps, join_at=join_at)
    for a, t in zip(alone, together):
        assert len(a) == len(t) and all(torch.equal(x, y) for x, y in zip(a, t))
    per_sequence = sum(steps) * packed.config.num_hidden_layers
    assert len(calls) <= per_sequence // 2  # grouped, not one call per sequence


def test_padded_sequences_at_different_lengths_share_an_attention_call_and_get_their_numbers_alone(
        tiny_lm, monkeypatch):
    """With `pad_to`, sequences whose lengths round up to the same multiple attend in one call, each at its
    own length in its slot (a staggered batch: joining at different steps, prompts of different lengths,
    crossing a multiple while in step, leaving early), bit for bit what each computes alone (padded the
    same way), and close to the unpadded numbers."""
    _, packed = tiny_lm
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    join_at, steps = [0, 1, 2, 2, 5], [12, 9, 12, 4, 7]
    alone = [run_packed(packed, [p], steps=[n], pad_to=8)[0][0] for p, n in zip(prompts, steps)]
    for p, n, a in zip(prompts, steps, alone):
        unpadded = run_packed(packed, [p], steps=[n])[0][0]
        assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(a, unpadded))
    calls = []
    monkeypatch.setattr(packed_module, "padded_sdpa", lambda *a: calls.append(1) or padded_sdpa(*a))
    together, _ = run_packed(packed, prompts, steps=steps, join_at=join_at, pad_to=8)
    for a, t in zip(alone, together):
        assert len(a) == len(t) and all(torch.equal(x, y) for x, y in zip(a, t))
    padded_calls, calls[:] = len(calls), []
    monkeypatch.setattr(packed_module, "sdpa_attention_forward",
                        lambda *a, **k: calls.append(1) or sdpa_attention_forward(*a, **k))
    run_packed(packed, prompts, steps=steps, join_at=join_at)
    assert 0 < padded_calls * 2 <= len(calls)  # unpadded, the staggered sequences attend one call each


ATTENTION_SHAPES = [(1, 1), (1, 7), (1, 33), (1, 100), (1, 300), (5, 5), (5, 7), (5, 100)]
# The CUDA twin: as the stages run there (bfloat16) and in float32; long caches too, where a kernel may split
# the keys by batch size. It has to run on a GPU: `_groups` stacks equal shapes on CUDA on its word.
CUDA_CASES = [pytest.param("cuda", dtype, n, kv, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: stacked vs lone attention is checked on a GPU only"))
    for dtype in (torch.bfloat16, torch.float32) for n, kv in [*ATTENTION_SHAPES, (1, 2000), (1, 8000), (16, 700)]]


@pytest.mark.parametrize("device, dtype, new_rows, kv_len",
                         [*(("cpu", torch.float32, n, kv) for n, kv in ATTENTION_SHAPES), *CUDA_CASES])
def test_a_stacked_attention_call_computes_each_sequence_as_alone(device, dtype, new_rows, kv_len):
    """The kernel facts `_Group` and `_KvBlock` rest on (tiny-LM shapes: 4 query heads over 2 KV heads,
    head_dim 64): a batch entry's result is the one it gets alone, and over views of the first rows of
    bigger buffers (with other numbers after them) the one over contiguous copies."""
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 2, True
    g = torch.Generator().manual_seed(kv_len)
    q, k_buf, v_buf = (torch.randn(6, heads, n, 64, generator=g).to(device, dtype)
                       for heads, n in ((4, new_rows), (2, 2 * kv_len + 3), (2, 2 * kv_len + 3)))
    k, v = k_buf[:, :, :kv_len], v_buf[:, :, :kv_len]
    past = kv_len - new_rows
    mask = (torch.ones(new_rows, kv_len, dtype=torch.bool, device=device).tril(past)[None, None]
            if new_rows > 1 and past > 0 else None)
    with torch.inference_mode():
        stacked, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.125, is_causal=True)
        copies, _ = sdpa_attention_forward(layer, q, k.contiguous(), v.contiguous(), mask, scaling=0.125,
                                           is_causal=True)
        assert torch.equal(stacked, copies)
        for i in range(6):
            one, _ = sdpa_attention_forward(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1], mask, scaling=0.125,
                                            is_causal=True)
            assert torch.equal(one, stacked[i:i + 1])


@pytest.mark.parametrize("device, dtype, new_rows, kv_len",
                         [*(("cpu", torch.float32, n, kv) for n, kv in ATTENTION_SHAPES), *CUDA_CASES])
def test_a_padded_attention_call_computes_each_sequence_as_alone(device, dtype, new_rows, kv_len):
    """The kernel fact padded groups rest on: slots at different lengths read to the same padded length,
    each with its own mask row (its keys up to each query, none past its own rows), get what each gets alone
    with its own mask, whatever the others' lengths."""
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 2, True
    g = torch.Generator().manual_seed(kv_len)
    read = kv_len + 31  # the padded length: up to 31 rows past the longest
    q, k, v = (torch.randn(6, heads, n, 64, generator=g).to(device, dtype)
               for heads, n in ((4, new_rows), (2, read), (2, read)))
    lengths = torch.tensor([max(kv_len - d, new_rows) for d in (0, 3, 1, 17, 30, 2)], device=device)
    past = (lengths - new_rows)[:, None] + torch.arange(new_rows, device=device)  # [slots, n]
    mask = (torch.arange(read, device=device) <= past[:, :, None])[:, None]
    for i, n in enumerate(lengths.tolist()):
        k[i, :, n:], v[i, :, n:] = 0, 0  # zeros past each slot's rows, as a padded block keeps them
    with torch.inference_mode():
        stacked = padded_sdpa(layer, q, k, v, mask, 0.125)
        for i in range(6):
            one = padded_sdpa(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1], mask[i:i + 1], 0.125)
            assert torch.equal(one, stacked[i:i + 1])


def test_a_cache_grows_in_place_and_keeps_its_rows():
    kv = SequenceKV()
    rows = seeded(1, 2, 100, 4)
    for s, e in [(0, 3), (3, 4), (4, 40), *((i, i + 1) for i in range(40, 100))]:
        k, v = kv.append(1, rows[:, :, s:e], -rows[:, :, s:e])
        assert torch.equal(k, rows[:, :, :e]) and torch.equal(v, -rows[:, :, :e])
    assert kv.length(1) == 100 and kv.length(0) == 0
    assert 2 * rows.nbytes <= kv.nbytes <= 4 * 2 * rows.nbytes  # spare room at most doubles it (plus MIN_ROWS)


def test_a_cache_never_grows_past_the_most_its_sequence_will_hold():
    """Doubling stops at the sequence's limit (prompt + max_tokens): the memory plan's KV per sequence."""
    rows = seeded(1, 2, 100, 4)
    kv = SequenceKV(limit=110)
    for s, e in [(0, 60), *((i, i + 1) for i in range(60, 100))]:
        k, _ = kv.append(0, rows[:, :, s:e], rows[:, :, s:e])
        assert torch.equal(k, rows[:, :, :e])
    row_bytes = rows.nbytes // 100
    assert kv.nbytes == 2 * 110 * row_bytes  # keys and values of 110 rows, not of 2 x 60 then 2 x 120
    a, b = SequenceKV(limit=50), SequenceKV(limit=80)
    block = _KvBlock.of([a, b])
    block.append(0, torch.zeros(2, 2, 40, 4), torch.zeros(2, 2, 40, 4))
    assert block.nbytes == 2 * 2 * 2 * 80 * 4 * 4  # the group's largest limit
    free = SequenceKV()
    free.append(0, rows[:, :, :60], rows[:, :, :60])
    assert free.nbytes == 2 * 120 * row_bytes  # without a limit room doubles


def test_a_block_mate_leaving_is_counted_against_the_survivor_until_its_next_step_frees_the_block():
    a, c = SequenceKV(), SequenceKV()
    block = _KvBlock.of([a, c])
    block.append(0, torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
    assert a.nbytes == c.nbytes == block.nbytes // 2
    a.clear()
    assert c.nbytes == block.nbytes   # it alone holds the block now: held bytes say so
    gone = weakref.ref(block)
    del block
    c.append(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))   # its next step: a block of its own
    gc.collect()
    assert gone() is None and c.length(0) == 4 and 0 < c.nbytes


def test_a_sequence_leaves_by_dropping_its_cache():
    kv = SequenceKV()
    kv.append(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    kv.append(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert kv.length(0) == 4 and kv.nbytes >= 2 * 2 * 4 * 4 * 4
    kv.clear()
    assert kv.length(0) == 0 and kv.nbytes == 0
