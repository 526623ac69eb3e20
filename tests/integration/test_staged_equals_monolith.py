"""The staged pipeline computes what the monolithic model computes: for a fixed prompt and greedy
decoding, the same text tokens and the same codec codes as transformers'
Qwen3OmniMoeForConditionalGeneration.generate on the very same weights."""

from __future__ import annotations

import pytest
import torch

from omnistage import tensors
from omnistage.client import AsyncOmniClient
from orchestrator_service.server import OrchestratorServer

from ..harness import call_stage, example, header, start_stage

PIPELINE = example("qwen3-omni-tiny")


@pytest.fixture(scope="module")
async def staged(model_dir):
    stages = {n: await start_stage(PIPELINE, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    orc = OrchestratorServer(PIPELINE, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
    await orc.start(wait_for_stages=30)
    yield orc, stages
    await orc.drain()
    for s in stages.values():
        await s.drain()


@pytest.fixture(scope="module")
def monolith(model_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir / "qwen3-omni-tiny").eval()


@pytest.mark.parametrize("prompt,max_tokens,frames,stop_at_eos", [
    ("Hello there", 10, 30, False),
    ("Tell me a short story about the sea and the wind, please.", 6, 60, True),
])
async def test_same_text_tokens_and_codec_codes(staged, monolith, prompt, max_tokens, frames, stop_at_eos):
    orc, stages = staged
    prompt_ids = stages["thinker"].engine.thinker.chat_prompt(prompt)
    with torch.inference_mode():
        seq, wav = monolith.generate(input_ids=torch.tensor([prompt_ids]), thinker_max_new_tokens=max_tokens,
                                     thinker_eos_token_id=151645 if stop_at_eos else None,
                                     talker_max_new_tokens=frames + 1, talker_do_sample=False)
    mono_tokens = seq[0, len(prompt_ids):].tolist()
    if stop_at_eos and mono_tokens[-1] == 151645:
        mono_tokens = mono_tokens[:-1]

    # Text tokens, through the orchestrator as a client sees them.
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        r = await client.generate(prompt, max_tokens=max_tokens, ignore_eos=not stop_at_eos,
                                  max_codec_frames=frames, timeout=120)
    staged_tokens = [t for t in r.token_ids if t != 151645]
    assert staged_tokens == mono_tokens

    # Codec codes: the Talker stage's output, decoded the way generate() decodes, equals generate()'s audio.
    params = dict(prompt=prompt, max_tokens=max_tokens, ignore_eos=not stop_at_eos, max_codec_frames=frames)
    thinker_out = await call_stage(stages["thinker"].port, header(**params))
    talker_out = await call_stage(stages["talker"].port, header(**params), thinker_out)
    codes = torch.cat([tensors.from_proto(t) for c in talker_out for t in c.tensors if t.name == "codes"], 1)
    with torch.inference_mode():
        from_staged_codes = monolith.code2wav.chunked_decode(codes[None], chunk_size=300, left_context_size=25)
    assert codes.shape[1] > 0 and torch.equal(from_staged_codes.float(), wav.float())
