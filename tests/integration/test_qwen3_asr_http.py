"""/v1/audio/transcriptions over the Qwen3-ASR pipeline, driven by the official `openai` SDK against an
in-process orchestrator and the tiny Qwen3-ASR stage: the answer is the transcript the model's own generate()
gives for the upload (the processor's prompt, the language forced), as json, as text and as SSE deltas; the
model's context and language come from the form's `prompt` and `language`; translations and uploads the model
cannot hear are refused naming the field, with nothing held after."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from stage_service.engines.qwen3_asr.engine import MARKER
from stage_service.engines.qwen3_asr.engine import transcript as read

from ..harness import example, start_stage
from ..media_builders import wav
from .test_http_api import Served, serve
from .test_http_transcriptions import endpoints
from .test_orchestrator_media import PNG

pytestmark = pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK's translations.create
MODEL = "qwen3-asr-tiny"
ASR = example(MODEL)
RATE = 16000
SAMPLES = (0.2 * np.random.default_rng(3).standard_normal(int(RATE * 1.6))).astype(np.float32)
CLIP = wav(SAMPLES, RATE, "FLOAT")


@pytest.fixture(scope="module")
async def served(model_dir):
    stage = await start_stage(ASR, "asr", model_dir)
    served = await serve(ASR, {"asr": stage})
    yield served
    await served.orc.drain()
    await stage.drain()


@pytest.fixture(scope="module")
def transcript(model_dir):
    """The model's own transcript of the clip: generate() greedy on the processor's prompt, its tokens read as
    the stage reads them (`engine.transcript`: the raw decode after the language header, no repetition
    collapsed; the whole answer where the header never ends)."""
    from transformers import Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor

    model = Qwen3ASRForConditionalGeneration.from_pretrained(model_dir / MODEL).eval()
    processor = Qwen3ASRProcessor.from_pretrained(model_dir / MODEL)
    tokenizer = processor.tokenizer

    def of(language: str | None, context: str | None = None) -> str:
        inputs = processor.apply_transcription_request(SAMPLES, language=language, prompt=context)
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False,
                                 max_new_tokens=ASR.limits.default_max_tokens)
        tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
        return read(tokens, lambda t: tokenizer.decode(t, skip_special_tokens=True),
                    tokenizer.convert_tokens_to_ids(MARKER), forced=language is not None).strip()
    return of


async def settled(served: Served) -> None:
    await served.until_idle()
    assert endpoints(served).budget.held == 0
    assert served.orc.servicer.admission.inflight == 0 and not served.orc.servicer.runs


async def test_json_and_text_are_the_models_transcript(served, transcript):
    client = served.aio()
    r = await client.audio.transcriptions.create(model=served.model, file=("clip.wav", CLIP), language="en")
    expected = transcript("English")
    assert r.text == expected and expected
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    text = await client.audio.transcriptions.create(model=served.model, file=("clip.wav", CLIP), language="en",
                                                    response_format="text")
    assert text.strip() == expected
    # The form's prompt is the model's context (its system turn): another prompt, another transcript.
    with_context = await client.audio.transcriptions.create(model=served.model, file=("clip.wav", CLIP),
                                                            language="de", prompt="Namen: Jürgen, Zoë")
    assert with_context.text == transcript("German", "Namen: Jürgen, Zoë")
    await settled(served)


async def test_stream_sends_the_transcript_as_deltas_then_done(served, transcript):
    stream = await served.aio().audio.transcriptions.create(model=served.model, file=("clip.wav", CLIP),
                                                            language="en", stream=True)
    events = [ev async for ev in stream]
    deltas = [ev.delta for ev in events if ev.type == "transcript.text.delta"]
    done = [ev for ev in events if ev.type == "transcript.text.done"]
    assert len(deltas) >= 2 and len(done) == 1 and events[-1] is done[0]
    assert "".join(deltas).strip() == done[0].text.strip() == transcript("English")
    await settled(served)


async def test_without_a_language_the_model_detects_it_and_only_the_transcript_is_sent(served, transcript):
    r = await served.aio().audio.transcriptions.create(model=served.model, file=("clip.wav", CLIP))
    expected = transcript(None)
    assert r.text == expected and expected and expected != transcript("English")
    await settled(served)


async def refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        await call
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


async def test_uploads_the_model_cannot_hear_and_translations_are_refused_naming_the_field(served):
    client = served.aio()
    create = client.audio.transcriptions.create
    await refused(create(model=served.model, file=("x.png", PNG)), "file")
    await refused(create(model=served.model, file=("x.txt", b"hello, this is text")), "file")
    long_clip = wav(np.zeros(int(RATE * (ASR.limits.max_audio_seconds + 1)), np.float32), RATE)
    message = await refused(create(model=served.model, file=("long.wav", long_clip)), "file")
    assert "the limit is 60 s" in message
    await refused(create(model=served.model, file=("clip.wav", CLIP), language="xx"), "language")
    message = await refused(client.audio.translations.create(model=served.model, file=("clip.wav", CLIP)), "model")
    assert "transcribes" in message
    await settled(served)
