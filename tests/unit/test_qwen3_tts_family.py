"""The Qwen3-TTS family's declarations and what the doors make of a text-to-speech pipeline, read without loading a
model: the family table (its talker reads the request's text, language and instructions itself; its decoder shares
the omni decoders' contract), the checkpoint's voices, and `/v1/audio/speech` sending the input as written with
its instructions (a Thinker pipeline refuses them)."""

from __future__ import annotations

import pytest

from omnistage.api import load_pipeline, reads_instructions, reads_language
from omnistage.checkpoints.configs import ar_text_config
from omnistage.checkpoints.voices import audio_stage, checkpoint_voices
from omnistage.contract.params import InvalidRequest
from omnistage.families import family_of
from omnistage.tiny_models.qwen3_tts import SPEAKERS, config_dict
from orchestrator_service.http_api import translate
from orchestrator_service.http_api.schemas import SpeechRequest

from ..conftest import EXAMPLES

TTS = load_pipeline(EXAMPLES / "qwen3-tts-tiny.yaml")
OMNI = load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")


def test_the_family_serves_a_text_reading_talker_and_the_nested_codec_decoder():
    family = family_of("Qwen3TTSForConditionalGeneration")
    assert family is not None and family.name == "qwen3_tts"
    assert family.components == ("tts_talker", "code2wav")
    talker, decoder = family.adapters
    assert talker.is_entry and talker.inputs == frozenset({"text"}) and talker.emits == frozenset({"codes"})
    assert talker.instructions and talker.language and talker.initial_chunk
    # The decoder is the omni decoders' stage (codes in, audio out), its weights in the speech tokenizer's folder.
    assert decoder.contract() == family_of("Qwen3OmniMoeForConditionalGeneration").adapters[2].contract()
    assert family.parts["code2wav"].folder == "speech_tokenizer"
    assert family.parts["code2wav"].config == "decoder_config" and family.parts["tts_talker"].folder == ""


def test_the_talkers_decoder_config_is_its_talker_config():
    published = config_dict()
    assert ar_text_config(published, "tts_talker") is published["talker_config"]


def test_only_a_text_to_speech_pipeline_reads_instructions():
    assert reads_instructions(TTS) and reads_language(TTS)
    assert not reads_instructions(OMNI)
    assert audio_stage(TTS).name == "talker"  # its voices are the talker's checkpoint's


def test_the_voices_are_the_checkpoints_named_speakers(model_dir):
    voices = checkpoint_voices(model_dir / "qwen3-tts-tiny")
    assert voices.names == tuple(SPEAKERS) and voices.default == next(iter(SPEAKERS))  # generate() names none


def test_speech_sends_a_tts_pipeline_the_input_as_written_with_its_instructions():
    t = translate.speech(SpeechRequest(input="Hello there", voice="ryan", instructions="Whisper it."), TTS)
    p = t.request.params
    assert p.prompt == "Hello there" and p.system_prompt == ""  # no Thinker to tell to repeat it
    assert p.audio.instructions == "Whisper it." and p.audio.speaker == "ryan"
    assert t.fields["params.audio.instructions"] == "instructions"


@pytest.mark.parametrize("pipeline, instructions, message", [
    (OMNI, "Whisper it.", "are not supported"),        # a Talker has no instructions to read
    (TTS, ["Whisper it."], "must be a string"),
])
def test_instructions_a_pipeline_cannot_take_are_refused_naming_them(pipeline, instructions, message):
    with pytest.raises(InvalidRequest) as e:
        translate.speech(SpeechRequest(input="Hello", instructions=instructions), pipeline)
    assert e.value.field == "instructions" and message in str(e.value)
