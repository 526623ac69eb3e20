"""A Qwen3-TTS Base checkpoint's reference clip, as the talker reads it (qwen-tts's `create_voice_clone_prompt`).

The clip is resampled to 24 kHz (librosa's default resampler, as qwen-tts resamples it), then:

- the speaker encoder (`speaker_encoder.` at the checkpoint's root: an ECAPA-TDNN over the clip's 128-bin log-mel
  spectrogram, the package's own `mel_spectrogram` at qwen-tts's settings) gives one row of the talker's width,
  which stands in the prompt where a CustomVoice checkpoint puts its named speaker's codec row;
- with a transcript (ICL mode) the speech tokenizer's encoder (`encoder.` in `speech_tokenizer/`, a Mimi encoder)
  gives the clip's codec frames [frames, groups]: the talker's prompt reads them under the transcript and the
  text, and the decoder decodes them as left context before the new frames, emitting only the new ones.

Blocking torch code, run on the stage's media threads, one clip at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnistage.checkpoints.configs import CheckpointError
from omnistage.checkpoints.qwen_tts import SPEECH_TOKENIZER_DIR, classes, with_rope_buffers
from omnistage.checkpoints.shards import ShardedCheckpoint
from stage_service.runtime.components import Piece

SPEAKER_ENCODER, CODEC_ENCODER = "speaker_encoder.", "encoder."
# qwen-tts's extract_speaker_embedding: the mel spectrogram the speaker encoder reads, at 24 kHz.
MEL = dict(n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256, win_size=1024, fmin=0, fmax=12000)


@dataclass(frozen=True)
class VoicePrompt:
    """What a cloned voice puts in the talker's prompt: the speaker row [H] and, in ICL mode, the clip's codec
    frames [frames, groups] and its transcript's token ids (None, None: x-vector mode)."""

    speaker: torch.Tensor
    codes: torch.Tensor | None = None
    ref_ids: tuple[int, ...] | None = None

    @property
    def frames(self) -> int:
        return 0 if self.codes is None else int(self.codes.shape[0])


def resample(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    """`samples` at `to` Hz as qwen-tts resamples a reference clip (librosa.resample's default)."""
    import librosa

    x = np.asarray(samples, dtype=np.float32)
    return x if rate == to else librosa.resample(y=x, orig_sr=int(rate), target_sr=int(to)).astype(np.float32)


class CloneEncoder:
    """The speaker encoder and the speech tokenizer's encoder of the Base checkpoint `ckpt` (the talker's)."""

    def __init__(self, ckpt: ShardedCheckpoint, combined, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        from transformers import AutoFeatureExtractor

        qt = classes()
        self.device, self.dtype = torch.device(device), dtype
        cfg = combined.speaker_encoder_config
        self.sample_rate = int(cfg.sample_rate)
        self.speaker_encoder = _load_module(ckpt, SPEAKER_ENCODER, qt.speaker_encoder(cfg),
                                            dtype, device)
        codec_root = ckpt.root / SPEECH_TOKENIZER_DIR
        codec_cfg = qt.codec_config.from_pretrained(str(codec_root))
        self.codec_encoder = with_rope_buffers(Piece(CODEC_ENCODER, qt.codec_encoder, codec_cfg.encoder_config).load(
            ShardedCheckpoint(codec_root), dtype, device))
        self.features = AutoFeatureExtractor.from_pretrained(str(codec_root))
        self.valid_groups = int(codec_cfg.encoder_valid_num_quantizers)
        self.downsample = int(codec_cfg.encode_downsample_rate)
        if int(self.features.sampling_rate) != self.sample_rate:
            raise CheckpointError(f"{codec_root}: the speech tokenizer reads {self.features.sampling_rate} Hz, the "
                                  f"speaker encoder {self.sample_rate} Hz (both read the clip at one rate)")

    @torch.inference_mode()
    def voice(self, samples: np.ndarray, rate: int, ref_ids: list[int] | None) -> VoicePrompt:
        """The clip (`samples` at `rate` Hz, mono) as the prompt reads it: ICL mode where `ref_ids` (its
        transcript's token ids) are given."""
        clip = resample(samples, rate, self.sample_rate)
        mels = classes().mel_spectrogram(torch.from_numpy(clip).unsqueeze(0), **MEL).transpose(1, 2)
        speaker = self.speaker_encoder(mels.to(self.device, self.dtype))[0]
        if ref_ids is None:
            return VoicePrompt(speaker)
        return VoicePrompt(speaker, self.codes(clip), tuple(ref_ids))

    def codes(self, clip: np.ndarray) -> torch.Tensor:
        """The clip's codec frames [frames, groups] (Qwen3TTSTokenizerV2Model.encode on one clip)."""
        inputs = self.features(raw_audio=[clip], sampling_rate=self.sample_rate, return_tensors="pt")
        values = inputs["input_values"].squeeze(1).to(self.device, self.dtype)
        encoded = self.codec_encoder.encode(input_values=values.unsqueeze(1), return_dict=True)
        frames = -(-int(inputs["padding_mask"].sum()) // self.downsample)
        return encoded.audio_codes[0, :self.valid_groups, :frames].transpose(0, 1)


def _load_module(ckpt: ShardedCheckpoint, prefix: str, module: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device | str) -> torch.nn.Module:
    """`module` (a plain torch module, not a transformers model) with the checkpoint's tensors under `prefix`;
    CheckpointError naming the first one missing or left over."""
    keys = ckpt.keys(prefix)
    if not keys:
        raise CheckpointError(f"{ckpt.index_file if ckpt.index_file.exists() else ckpt.root}: no tensors under "
                              f"{prefix!r} (a Base checkpoint keeps its speaker encoder there)")
    result = module.load_state_dict({k[len(prefix):]: ckpt.read(k) for k in keys}, strict=False)
    if result.missing_keys or result.unexpected_keys:
        which, key = (("missing from the checkpoint", result.missing_keys[0]) if result.missing_keys else
                      ("not in the module", result.unexpected_keys[0]))
        raise CheckpointError(f"{ckpt.root}: tensor {prefix}{key} {which}")
    return module.to(device, dtype).eval()
