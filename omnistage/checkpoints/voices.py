"""The voices a pipeline can speak in, read from its audio stages' checkpoint (configs only, no weights).

The orchestrator reads them at start from the model store, as it reads the limits (`defaults.py`), so
that a request's voice is checked before any stage runs:

- Qwen3-Omni: `config.json` `talker_config.speaker_id` (name -> codec token), its keys;
- Qwen3-TTS (CustomVoice): `config.json` `talker_config.spk_id`, the same map under another name; a Base
  checkpoint (`tts_model_type` `base`) has no named voices: it speaks in the voice of each request's reference clip;
- Qwen2.5-Omni: `spk_dict.pt` at the checkpoint's root (name -> conditioning, reference mel, bos token), a
  torch pickle whose top-level keys are read here without torch: its `data.pkl` is unpickled with every
  tensor left a stand-in (`_SpeakerNames`), so no storage is read and no class outside a short list is
  ever imported.

The voices keep the checkpoint's spelling and order. Its default is the voice the model's own `generate()`
speaks in when none is named (Qwen3-Omni: Ethan, Qwen2.5-Omni: Chelsie), else its first (Qwen3-TTS names
none). The checkpoint read is the Talker's (the stage whose `component` is `talker` or `tts_talker` upstream of
the audio output), else the audio output stage's own.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.api import Pipeline, Stage
from omnistage.checkpoints.configs import CheckpointError, read_json
from omnistage.checkpoints.names import QWEN2_5_OMNI_SPEAKERS
from omnistage.contract.launch import checkpoint_dir

# The speaker table's pickle holds names and tensor headers only (the tensors lie beside it in the archive):
# a few hundred bytes for two speakers. A larger one is not a speaker table.
MAX_SPEAKER_PICKLE_BYTES = 1 << 20
TALKER_COMPONENTS = ("talker", "tts_talker")  # an omni Talker, a text-to-speech talker
# The voice each family's own generate() uses when none is named (transformers' Qwen3OmniMoeForConditionalGeneration
# and Qwen2_5OmniForConditionalGeneration): a pipeline that names no default speaks as the model does upstream.
QWEN3_OMNI_DEFAULT_VOICE = "Ethan"
QWEN2_5_OMNI_DEFAULT_VOICE = "Chelsie"


@dataclass(frozen=True)
class CheckpointVoices:
    names: tuple[str, ...]   # the checkpoint's spelling and order
    default: str             # the model's own default voice, in the checkpoint's spelling
    clones: bool = False     # no named voices: a request's reference clip is its voice (a Qwen3-TTS Base model)

    @classmethod
    def of(cls, names: tuple[str, ...], upstream_default: str) -> "CheckpointVoices":
        """`names` with `upstream_default` as the default when it is one of them (in any case), else the first."""
        found = next((n for n in names if n.lower() == upstream_default.lower()), names[0])
        return cls(names, found)


def audio_stage(pipeline: Pipeline) -> Stage | None:
    """The stage whose voice the `audio` output speaks in: the Talker upstream of it, else the output's own
    stage; None when the pipeline has no audio output."""
    out = next((o for o in pipeline.outputs if o.modality == "audio"), None)
    if out is None:
        return None
    seen: set[str] = set()
    todo = [out.stage]
    while todo:
        stage = pipeline.stage(todo.pop())
        if stage.component in TALKER_COMPONENTS:
            return stage
        seen.add(stage.name)
        todo += [e.source for e in stage.inputs if e.source not in seen]
    return pipeline.stage(out.stage)


def checkpoint_voices(directory: str | os.PathLike) -> CheckpointVoices:
    """The voices of the combined checkpoint in `directory`; CheckpointError when it names none (or its files
    cannot be read)."""
    directory = Path(directory)
    config = read_json(directory / "config.json")
    if config.get("tts_model_type") == "base":  # Qwen3-TTS Base: the voice is each request's reference clip
        return CheckpointVoices((), "", clones=True)
    talker = config.get("talker_config") or {}
    speakers = talker.get("speaker_id") if isinstance(talker, dict) else None
    if isinstance(speakers, dict) and speakers:
        return CheckpointVoices.of(tuple(str(name) for name in speakers), QWEN3_OMNI_DEFAULT_VOICE)
    speakers = talker.get("spk_id") if isinstance(talker, dict) else None
    if isinstance(speakers, dict) and speakers:  # Qwen3-TTS: generate() has no default speaker
        return CheckpointVoices.of(tuple(str(name) for name in speakers), "")
    table = directory / QWEN2_5_OMNI_SPEAKERS
    if table.is_file():
        return CheckpointVoices.of(speaker_table_names(table), QWEN2_5_OMNI_DEFAULT_VOICE)
    raise CheckpointError(f"{directory}: no voices (no talker_config.speaker_id or spk_id in config.json, no "
                          f"{QWEN2_5_OMNI_SPEAKERS})")


def pipeline_voices(pipeline: Pipeline, root: str | os.PathLike | None = None) -> CheckpointVoices | None:
    """The voices of `pipeline`'s audio output (None: it has none), from its checkpoint under the model store
    `root`; CheckpointError (or OSError) when that cannot be read."""
    stage = audio_stage(pipeline)
    return None if stage is None else checkpoint_voices(checkpoint_dir(stage, root))


def speaker_table_names(file: Path) -> tuple[str, ...]:
    """The top-level keys of a torch-saved dict (`spk_dict.pt`), in order, read without torch."""
    try:
        with zipfile.ZipFile(file) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pickles) != 1:
                raise CheckpointError(f"{file}: not a torch archive (no data.pkl)")
            if archive.getinfo(pickles[0]).file_size > MAX_SPEAKER_PICKLE_BYTES:
                raise CheckpointError(f"{file}: its data.pkl is over {MAX_SPEAKER_PICKLE_BYTES} bytes (not a "
                                      "speaker table)")
            data = archive.read(pickles[0])
        _check_opcodes(data, file)
        table = _SpeakerNames(io.BytesIO(data)).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, MemoryError,
            RecursionError) as e:
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(table, dict) or not table or not all(isinstance(k, str) for k in table):
        raise CheckpointError(f"{file}: no speakers (a speaker table maps names to their settings)")
    return tuple(table)


# A speaker table's pickle, walked before it is loaded: a memo index or an opcode count past these bounds is
# no speaker table (a hostile one could make the unpickler allocate a memo of any size). A real table has a
# few hundred opcodes per speaker. The checkpoint is the operator's, as trusted as its weights: these bound
# mistakes and memory, not every slow pickle.
MAX_MEMO_INDEX = 1 << 16
MAX_OPCODES = 1 << 20


def _check_opcodes(data: bytes, file: Path) -> None:
    import pickletools

    for count, (op, arg, _) in enumerate(pickletools.genops(data)):
        if count >= MAX_OPCODES:
            raise CheckpointError(f"{file}: its data.pkl has over {MAX_OPCODES} opcodes (not a speaker table)")
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET") and \
                isinstance(arg, int) and arg > MAX_MEMO_INDEX:
            raise CheckpointError(f"{file}: its data.pkl uses memo index {arg} (not a speaker table)")


class _Opaque:
    """What a tensor, a storage or any other torch object in the table reads as: nothing (its bytes are
    never read)."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _SpeakerNames(pickle.Unpickler):
    """Unpickles a torch archive's data.pkl with every torch global a stand-in and storages not loaded; any
    other global but OrderedDict is refused (a pickle can otherwise name any callable)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return _Opaque
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a speaker table")

    def persistent_load(self, pid: Any) -> Any:
        return None
