"""Batch invariance helpers and packed attention: a row's numbers do not depend on its batch, and
packed steps compute what transformers' own cached forward computes. Plain torch modules and a
tiny random decoder built in memory: no files."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from stage_service.engines.invariance import make_batch_invariant, pad_rows
from stage_service.engines.packed import SequenceKV, packed_forward, use_packed_attention


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


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_conv_and_group_norm_rows_are_the_same_alone_and_in_a_batch(batch):
    net = make_batch_invariant(torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.GroupNorm(4, 16)))
    x = seeded(6, 8, 12, 12)
    with torch.no_grad():
        full = net(x)
        assert torch.equal(net(x[:batch]), full[:batch])
        channels_last = x[:batch].to(memory_format=torch.channels_last)
        assert torch.equal(net(channels_last), full[:batch])


def test_pad_rows():
    x = torch.ones(2, 3)
    assert pad_rows(x).shape == (4, 3) and pad_rows(x)[2:].abs().sum() == 0
    assert pad_rows(torch.ones(5, 3)).shape == (5, 3)


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


def run_packed(model, prompts: list[list[int]], steps: int, join_at: list[int] | None = None):
    """Greedy decode; sequence i joins at step join_at[i]. Returns each sequence's last-position logits per step."""
    join_at = join_at or [0] * len(prompts)
    caches = [SequenceKV() for _ in prompts]
    fed: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.inference_mode():
        for step in range(steps + max(join_at)):
            live = [i for i in range(len(prompts)) if join_at[i] <= step < join_at[i] + steps]
            inputs = [torch.tensor(fed[i][-1:] if fed[i] else prompts[i]) for i in live]
            last, _ = packed_forward(model.get_decoder(), inputs, [caches[i] for i in live],
                                     embed=model.get_input_embeddings())
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


def test_a_sequence_leaves_by_dropping_its_cache():
    kv = SequenceKV()
    kv.append(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    kv.append(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert kv.length(0) == 4 and kv.nbytes == 2 * 2 * 4 * 4 * 4
    kv.clear()
    assert kv.length(0) == 0 and kv.nbytes == 0
