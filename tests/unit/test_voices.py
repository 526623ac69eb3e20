"""A pipeline's voices: read from checkpoint configs (Qwen3-Omni's config.json, Qwen2.5-Omni's spk_dict.pt read
without torch) and chosen for a request (default, any case, aliases, OpenAI names refused with the list)."""

from __future__ import annotations

import io
import json
import pickle
import zipfile

import pytest
import torch

from omnistage.checkpoints.configs import CheckpointError
from omnistage.checkpoints.voices import audio_stage, checkpoint_voices, speaker_table_names
from omnistage.contract.params import InvalidRequest
from orchestrator_service.voices import OPENAI_VOICES, SPEAKER_FIELD, VoiceError, Voices

from ..harness import example

QWEN3_SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


def qwen3_checkpoint(path, speakers=QWEN3_SPEAKERS):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe",
                                                  "talker_config": {"speaker_id": speakers}}))
    return path


def qwen2_5_checkpoint(path, names=("Chelsie", "Ethan")):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni", "talker_config": {}}))
    torch.save({n: {"cond": torch.zeros(1, 4), "ref_mel": torch.zeros(1, 3, 2), "bos_token": 151870 + i}
                for i, n in enumerate(names)}, path / "spk_dict.pt")
    return path


# ------------------------------------------------------------------ reading

def test_qwen3_voices_are_the_talker_config_speaker_ids_in_order(tmp_path):
    found = checkpoint_voices(qwen3_checkpoint(tmp_path / "q3"))
    assert found.names == ("chelsie", "ethan", "aiden") and found.default == "ethan"  # upstream's own default


def test_qwen2_5_voices_are_the_speaker_table_keys_read_without_torch(tmp_path):
    found = checkpoint_voices(qwen2_5_checkpoint(tmp_path / "q25"))
    assert found.names == ("Chelsie", "Ethan") and found.default == "Chelsie"


def test_the_default_is_the_first_voice_when_the_model_default_is_absent(tmp_path):
    found = checkpoint_voices(qwen3_checkpoint(tmp_path / "q3", {"serena": 1, "ryan": 2}))
    assert found.names == ("serena", "ryan") and found.default == "serena"


def test_a_base_checkpoint_has_no_named_voices_and_refuses_any_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts", "tts_model_type": "base",
                                                      "talker_config": {"spk_id": {}}}))
    found = checkpoint_voices(tmp_path)
    assert found.clones and found.names == ()
    clones = Voices(clones=True)
    assert clones.choose("") == "" and clones.choose("Default") == ""  # the stage speaks the clip's voice
    for asked in ("ethan", "alloy", "vivian"):
        with pytest.raises(InvalidRequest) as e:
            clones.choose(asked)
        assert e.value.field == SPEAKER_FIELD and "no named voices" in str(e.value) and "reference clip" in str(e.value)


def test_a_checkpoint_without_voices_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(CheckpointError, match="no voices"):
        checkpoint_voices(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        checkpoint_voices(tmp_path / "missing")


def hostile_archive(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("spk_dict/data.pkl", payload)
    return path


class Runs:
    def __reduce__(self):
        return (print, ("never",))


@pytest.mark.parametrize("payload, why", [
    (pickle.dumps(Runs(), protocol=2), "print is not part of a speaker table"),
    (pickle.dumps({}, protocol=2), "no speakers"),
    (b"\x80\x02}q", "unreadable"),
    # A memo index of a billion: the unpickler would allocate a memo of that size before failing.
    (b"\x80\x02}r\xff\xff\xff\x3f.", "memo index"),
    (pickle.dumps({1: "a"}, protocol=2), "no speakers"),   # keys that are not names
])
def test_a_speaker_table_that_is_not_one_is_refused_and_never_run(tmp_path, capsys, payload, why):
    with pytest.raises(CheckpointError, match=why):
        speaker_table_names(hostile_archive(tmp_path / "spk_dict.pt", payload))
    assert "never" not in capsys.readouterr().out


def test_a_speaker_table_that_is_not_an_archive_is_refused(tmp_path):
    (tmp_path / "spk_dict.pt").write_bytes(b"")  # the hollow layout's placeholder
    with pytest.raises(CheckpointError, match="unreadable"):
        speaker_table_names(tmp_path / "spk_dict.pt")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a/other.bin", b"")
    (tmp_path / "other.pt").write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError, match="no data.pkl"):
        speaker_table_names(tmp_path / "other.pt")


def test_the_audio_stage_is_the_talker_upstream_of_the_audio_output():
    assert audio_stage(example("qwen3-omni-tiny")).name == "talker"
    assert audio_stage(example("qwen2.5-omni-tiny")).name == "talker"
    assert audio_stage(example("llm-tiny")) is None


# ------------------------------------------------------------------ choosing

Q3 = Voices.of(("chelsie", "ethan", "aiden"), "ethan")
Q25 = Voices.of(("Chelsie", "Ethan"), "Chelsie", aliases={"Alloy": "ethan"})


@pytest.mark.parametrize("voices, asked, sent", [
    (Q3, "", "ethan"), (Q3, "default", "ethan"), (Q3, "DEFAULT", "ethan"), (Q3, "Chelsie", "chelsie"),
    (Q3, "AIDEN", "aiden"), (Q25, "", "Chelsie"), (Q25, "ethan", "Ethan"), (Q25, "alloy", "Ethan"),
    (Q25, "ALLOY", "Ethan"),
    (Voices.of(("Chelsie", "Ethan"), "Chelsie", default_voice="ETHAN"), "default", "Ethan"),
    (Voices.of(("Chelsie", "Ethan"), "Chelsie", default_voice="nova", aliases={"nova": "chelsie"}), "", "Chelsie"),
])
def test_a_voice_is_sent_in_the_checkpoints_spelling(voices, asked, sent):
    assert voices.choose(asked) == sent


@pytest.mark.parametrize("asked, why", [("nobody", "is not a voice of this pipeline"),
                                        *[(v, "is an OpenAI voice this pipeline does not map")
                                          for v in OPENAI_VOICES if v != "alloy"]])
def test_an_unknown_voice_is_refused_with_the_list(asked, why):
    with pytest.raises(InvalidRequest) as e:
        Q25.choose(asked)
    assert e.value.field == SPEAKER_FIELD and why in str(e.value)
    assert "Chelsie, Ethan (default Chelsie)" in str(e.value) and "alloy -> Ethan" in str(e.value)


def test_unknown_voices_pass_as_named_for_the_talker_to_check():
    unknown = Voices.of((), "", aliases={"alloy": "Chelsie"})
    assert not unknown.known
    assert unknown.choose("") == "" and unknown.choose("default") == ""  # the stage's own default
    assert unknown.choose("nobody") == "nobody" and unknown.choose("Alloy") == "Chelsie"
    assert Voices.of((), "", default_voice="Ethan").choose("default") == "Ethan"


@pytest.mark.parametrize("kw, why", [
    (dict(default_voice="nobody"), "limits.defaultVoice: 'nobody' is not a voice"),
    (dict(aliases={"alloy": "nobody"}), "limits.voiceAliases.alloy: 'nobody' is not a voice"),
    (dict(aliases={"alloy": "Ethan", "ALLOY": "Chelsie"}), "given twice"),
])
def test_a_file_naming_voices_the_checkpoint_lacks_is_refused(kw, why):
    with pytest.raises(VoiceError, match=why):
        Voices.of(("Chelsie", "Ethan"), "Chelsie", **kw)
