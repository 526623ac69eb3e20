"""The staged Qwen2.5-Omni pipeline computes what the combined model computes: for a fixed prompt, greedy
decoding and a fixed seed, the same text tokens and the same codec codes as transformers'
Qwen2_5OmniForConditionalGeneration.generate on the very same checkpoint, and audio that differs from
generate()'s only by Token2Wav's chunking (which decodes the codes as they stream in)."""

from __future__ import annotations

import pytest
import torch

from omnistage.client import AsyncOmniClient
from stage_service.engines.omni.audio import to_pcm16
from stage_service.engines.qwen2_5_omni.steps import SPEECH_SYSTEM_PROMPT

from ..harness import call_stage, example, header, in_engine_process, served_pipeline, tensor_of

MODEL = "qwen2.5-omni-tiny"
PIPELINE = example(MODEL)


def thinker_on_vllm(doc: dict) -> None:
    next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == "thinker")["engine"] = "vllm"


@pytest.fixture(scope="module", params=[
    "talker-in-process", "talker-engine-process", pytest.param("thinker-vllm", marks=pytest.mark.vllm)])
async def staged(model_dir, request):
    pipeline = {"talker-in-process": PIPELINE, "talker-engine-process": in_engine_process(MODEL, "talker"),
                "thinker-vllm": example(MODEL, thinker_on_vllm)}[request.param]
    async with served_pipeline(pipeline, model_dir) as (orc, stages):
        assert (stages["talker"].engine.core is not None) == (request.param == "talker-engine-process")
        assert hasattr(stages["thinker"].engine, "rows") == (request.param == "thinker-vllm")
        yield orc, stages


class Checkpoint:
    """The prompt policy and stop tokens as a transformers user reads them off the checkpoint."""

    def __init__(self, root):
        from transformers import AutoTokenizer

        from stage_service.engines.qwen2_5_omni.steps import _stop_ids
        from stage_service.runtime.chat import load_chat_template

        self.tokenizer = AutoTokenizer.from_pretrained(root)
        self.chat_template = load_chat_template(root, self.tokenizer)
        self.stop_ids = _stop_ids(root, self.tokenizer)


def _prompt_mask(module, args, kwargs):
    """transformers 5 drops an all-ones attention mask before the Talker's forward, and the Talker adds the
    codec pad and start embeddings to its last two prompt rows only when it gets a mask; the model was
    trained with them (the original Qwen code and transformers 4 always add them). Hand the Talker's
    prefill its mask, so the reference is the model's own computation."""
    if kwargs.get("inputs_embeds") is not None and kwargs.get("attention_mask") is None:
        kwargs["attention_mask"] = torch.ones(kwargs["inputs_embeds"].shape[:2], dtype=torch.long)
    return args, kwargs


@pytest.fixture(scope="module")
def monolith(model_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir / MODEL).eval()
    model.talker.register_forward_pre_hook(_prompt_mask, with_kwargs=True)
    return model


@pytest.mark.parametrize("prompt,max_tokens,frames,stop_at_eos,seed", [
    ("Hello there", 10, 40, False, 0),
    ("Tell me a short story about the sea and the wind, please.", 6, 60, True, 7),
])
async def test_same_text_tokens_and_codec_codes_and_close_audio(staged, monolith, model_dir, prompt, max_tokens,
                                                               frames, stop_at_eos, seed):
    orc, stages = staged
    thinker = Checkpoint(model_dir / MODEL)
    # The monolith's prompt as its processor makes it: the template rendered, then tokenized whole.
    messages = [{"role": "system", "content": SPEECH_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    rendered = thinker.tokenizer.apply_chat_template(messages, chat_template=thinker.chat_template, tokenize=False,
                                                     add_generation_prompt=True)
    prompt_ids = thinker.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    handed_to_token2wav = []
    hook = monolith.token2wav.register_forward_pre_hook(
        lambda module, args, kwargs: handed_to_token2wav.append(args[0] if args else kwargs["code"]), with_kwargs=True)
    try:
        torch.manual_seed(seed)  # Token2Wav's flow starts from torch's default generator: seeded as the stage seeds
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            seq, wav = monolith.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Ethan", thinker_max_new_tokens=max_tokens,
                thinker_do_sample=False, thinker_eos_token_id=sorted(thinker.stop_ids) if stop_at_eos else None,
                talker_max_new_tokens=frames, talker_do_sample=False)
    finally:
        hook.remove()
    mono_tokens = [t for t in seq[0, len(prompt_ids):].tolist() if t not in thinker.stop_ids]
    mono_codes = handed_to_token2wav[0]

    # Text tokens and audio, through the orchestrator as a client gets them.
    async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
        r = await client.generate(prompt, max_tokens=max_tokens, ignore_eos=not stop_at_eos, max_codec_frames=frames,
                                  seed=seed, speaker="Ethan", timeout=120)  # the monolith's voice
    assert [t for t in r.token_ids if t not in thinker.stop_ids] == mono_tokens

    # Codec codes: the Talker stage's output equals what generate() hands Token2Wav.
    params = dict(prompt=prompt, max_tokens=max_tokens, ignore_eos=not stop_at_eos, max_codec_frames=frames, seed=seed)
    thinker_out = await call_stage(stages["thinker"].port, header(**params))
    talker_out = await call_stage(stages["talker"].port, header(**params), thinker_out)
    codes = torch.cat([tensor_of(c, "codes") for c in talker_out], 1)
    assert codes.shape[1] > 0 and torch.equal(codes, mono_codes)

    # Audio: generate() decodes the codes at once, the stage as they stream in (chunks of 24 here).
    pcm = torch.frombuffer(bytearray(r.pcm), dtype=torch.int16)
    reference = to_pcm16(wav)
    assert r.sample_rate == 24000 and len(pcm) == len(reference) == codes.shape[1] * 480
    error = (pcm.float() - reference.float()).pow(2).mean().sqrt() / reference.float().pow(2).mean().sqrt()
    # Chunk windows (the DiT) and unpadded kernels (generate() runs without batch invariance) move it
    # slightly: ~4e-5 here, where a different half of the codes moves it by more than 1e-2.
    assert error < 3e-4, f"relative RMS error {float(error):.2e}"
