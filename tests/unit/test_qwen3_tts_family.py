"""The Qwen3-TTS family's declarations and what the doors make of a text-to-speech pipeline, read without loading a
model: the family table (its talker reads the request's text, language and instructions itself; its decoder shares
the omni decoders' contract), the checkpoint's voices, and `/v1/audio/speech` sending the input as written with
its instructions (a Thinker pipeline refuses them); voice cloning: the Base checkpoint's layout and its door fields
(`ref_audio`, `ref_text`, `x_vector_only_mode`) into one audio part and `params.audio.ref_text`, refused by name
where they cannot be served."""

from __future__ import annotations

import base64

import pytest

from omnistage.api import Limits, load_pipeline, reads_instructions, reads_language
from omnistage.checkpoints.configs import ar_text_config
from omnistage.checkpoints.voices import audio_stage, checkpoint_voices
from omnistage.contract.params import InvalidRequest, resolve
from omnistage.contract.request import build_request
from omnistage.families import family_of
from omnistage.tiny_models.qwen3_tts import BASE, SPEAKERS, config_dict
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
    # It reads text, and on a Base checkpoint one audio part: the voice to clone.
    assert talker.is_entry and talker.inputs == frozenset({"text", "audio"}) and talker.emits == frozenset({"codes"})
    assert talker.instructions and talker.language and talker.initial_chunk
    # The decoder is the omni decoders' stage (codes in, audio out), its weights in the speech tokenizer's folder.
    assert decoder.contract() == family_of("Qwen3OmniMoeForConditionalGeneration").adapters[2].contract()
    assert family.parts["code2wav"].folder == "speech_tokenizer"
    assert family.parts["code2wav"].config == "decoder_config" and family.parts["tts_talker"].folder == ""
    # The talker stage reads a Base checkpoint's speaker encoder beside the talker.
    assert family.parts["tts_talker"].prefix == ("talker.", "speaker_encoder.")


def test_the_base_checkpoint_is_published_without_named_speakers_and_with_a_speaker_encoder():
    published = config_dict(BASE)
    assert published["tts_model_type"] == "base"
    assert published["talker_config"]["spk_id"] == {} and published["talker_config"]["spk_is_dialect"] == {}
    encoder = published["speaker_encoder_config"]
    assert encoder["enc_dim"] == published["talker_config"]["hidden_size"] and encoder["sample_rate"] == 24000


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


def test_a_base_pipeline_has_no_named_voices_and_a_file_naming_one_does_not_start(model_dir):
    import dataclasses

    from orchestrator_service.voices import VoiceError, Voices

    base = load_pipeline(EXAMPLES / "qwen3-tts-base-tiny.yaml")
    voices = Voices.read(base, model_dir)
    assert voices is not None and voices.clones and voices.names == ()
    for limits in (dict(default_voice="vivian"), dict(voice_aliases={"alloy": "vivian"})):
        named = dataclasses.replace(base, limits=dataclasses.replace(base.limits, **limits))
        with pytest.raises(VoiceError, match="no named voices"):
            Voices.read(named, model_dir)


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


BASE_TTS = load_pipeline(EXAMPLES / "qwen3-tts-base-tiny.yaml")
CLIP = b"RIFF....WAVEfmt "  # the door passes the bytes on: the media checks decode them
CLIP_URL = "data:audio/wav;base64," + base64.b64encode(CLIP).decode()


@pytest.mark.parametrize("ref_audio", [CLIP_URL, base64.b64encode(CLIP).decode()])
def test_speech_sends_the_reference_clip_as_the_one_audio_part_and_its_transcript(ref_audio):
    t = translate.speech(SpeechRequest(input="Hello there", ref_audio=ref_audio, ref_text="Hi."), BASE_TTS)
    p = t.request.params
    assert [x.WhichOneof("part") for x in p.parts] == ["audio"] and p.parts[0].audio.data == CLIP
    assert p.audio.ref_text == "Hi." and p.prompt == "Hello there"
    assert t.fields["params.parts"] == "ref_audio" and t.fields["params.audio.ref_text"] == "ref_text"
    plain = translate.speech(SpeechRequest(input="Hello there", ref_audio=CLIP_URL, x_vector_only_mode=True),
                             BASE_TTS).request.params
    assert len(plain.parts) == 1 and plain.audio.ref_text == ""
    assert not translate.speech(SpeechRequest(input="Hello", voice="ryan"), TTS).request.params.parts


@pytest.mark.parametrize("fields, param, message", [
    ({"ref_audio": "https://example.com/a.wav"}, "ref_audio", "not fetched"),
    ({"ref_audio": "data:image/png;base64,AAAA"}, "ref_audio", "not an audio"),
    ({"ref_audio": "not base64!"}, "ref_audio", "not valid base64"),
    ({"ref_audio": CLIP_URL, "ref_text": "Hi.", "x_vector_only_mode": True}, "x_vector_only_mode", "one or the other"),
    ({"ref_audio": CLIP_URL, "x_vector_only_mode": False}, "ref_text", "is required"),
    ({"ref_text": "Hi."}, "ref_text", "ref_audio"),
    ({"x_vector_only_mode": True}, "x_vector_only_mode", "ref_audio"),
])
def test_cloning_fields_the_door_cannot_send_are_refused_naming_them(fields, param, message):
    with pytest.raises(InvalidRequest) as e:
        translate.speech(SpeechRequest(input="Hello", **fields), BASE_TTS)
    assert e.value.field == param and message in str(e.value)


def test_a_reference_transcript_is_bounded_and_carried_by_resolve():
    limits = Limits(max_prompt_chars=20)
    assert resolve(build_request("Hello", ref_text="Hi there.").params, limits).ref_text == "Hi there."
    with pytest.raises(InvalidRequest) as e:
        resolve(build_request("Hello", ref_text="x" * 21).params, limits)
    assert e.value.field == "params.audio.ref_text"
