"""The memory plan's KV arithmetic on hand-written configs (layers x KV heads x head dim x 2 x dtype bytes,
read from the component's own decoder config), and the chunks of a decoder's largest step."""

from __future__ import annotations

import pytest

from omnistage.api import StageDeployment
from omnistage.checkpoints.plan import ar_text_config, kv_bytes_per_token, stage_dtype, steps_chunks
from omnistage.checkpoints.shards import CheckpointError

LM = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}


@pytest.mark.parametrize("config,dtype_bytes,expected", [
    (LM, 4, 4 * 2 * 32 * 2 * 4),                                           # head_dim = hidden / heads
    (LM, 2, 4 * 2 * 32 * 2 * 2),
    ({**LM, "head_dim": 128}, 2, 4 * 2 * 128 * 2 * 2),                     # head_dim given wins
    ({**LM, "num_key_value_heads": None}, 2, 4 * 8 * 32 * 2 * 2),          # no GQA: every head keeps KV
    ({k: v for k, v in LM.items() if k != "num_key_value_heads"}, 4, 4 * 8 * 32 * 2 * 4),
    ({"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size": 2048,
      "head_dim": 128}, 2, 98_304),                                         # Qwen3-Omni-30B's Thinker in bf16
])
def test_kv_bytes_per_token(config, dtype_bytes, expected):
    assert kv_bytes_per_token(config, dtype_bytes) == expected


THINKER_TEXT = {**LM, "num_hidden_layers": 6}
TALKER_TEXT = {**LM, "num_hidden_layers": 3}
OMNI = {"thinker_config": {"text_config": THINKER_TEXT, "audio_config": {"num_hidden_layers": 9}},
        "talker_config": {"text_config": TALKER_TEXT, "code_predictor_config": {"num_hidden_layers": 1}}}


@pytest.mark.parametrize("config,component,expected", [
    (OMNI, "thinker", THINKER_TEXT),
    (OMNI, "talker", TALKER_TEXT),
    ({"talker_config": TALKER_TEXT}, "talker", TALKER_TEXT),   # Qwen2.5-Omni's flat Talker config
    (LM, "", LM),                                               # a causal LM: the root
])
def test_the_components_own_decoder_config_is_read(config, component, expected):
    assert ar_text_config(config, component) == expected


def test_no_decoder_config_is_named():
    with pytest.raises(CheckpointError, match="code2wav"):
        ar_text_config(OMNI, "code2wav")


@pytest.mark.parametrize("dtype,gpus,device,expected", [
    ("auto", 0, "cpu", "float32"),
    ("auto", 1, "cuda", "bfloat16"),
    ("float16", 1, "cuda", "float16"),
    ("bfloat16", 0, "cpu", "bfloat16"),
])
def test_stage_dtype_resolves_auto_per_device(dtype, gpus, device, expected):
    assert stage_dtype(StageDeployment(dtype=dtype, gpus=gpus), device) == expected


def test_a_stage_without_a_deployment_entry_runs_in_the_auto_dtype():
    assert stage_dtype(None, "cpu") == "float32"


@pytest.mark.parametrize("batch,cost,bound,expected", [
    (8, 50, None, 8),       # no frames-per-step bound (a GPU): maxBatch chunks
    (8, 50, 100, 2),        # Code2Wav's CPU default: two chunks of 25 + 25 frames
    (8, 60, 200, 3),        # Token2Wav's CPU default: three chunks of the steady 60-token window
    (8, 60, 1, 1),          # a chunk larger than the bound still steps, alone
    (2, 10, 1000, 2),       # maxBatch bounds it first
])
def test_a_decoders_largest_step_takes_what_maxbatch_and_its_bound_allow(batch, cost, bound, expected):
    assert steps_chunks(batch, cost, bound) == expected
