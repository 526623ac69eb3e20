"""Qwen2.5-Omni Token2Wav, chunked: codec tokens -> mel spectrogram (a DiT integrated as a flow-matching
ODE) -> 24 kHz waveform (BigVGAN), decoded as the tokens arrive.

How chunk boundaries are handled, so streamed audio matches decoding the whole sequence as closely as
the model allows:

- **DiT.** Its attention is block-local: `block_size` mel frames (= `block_size / repeats` codec tokens)
  per block, some layers also seeing one block back or ahead. A chunk decodes whole blocks [a, b) of
  tokens inside a window of `LEFT_BLOCKS` blocks of earlier tokens and `RIGHT_BLOCKS` blocks of later
  ones (so a chunk waits for those), aligned to blocks so every block has the same neighbours as in a
  whole decode; only [a, b)'s mel frames are kept. The ODE starts from noise drawn position by
  position from the request's seeded generator, so every frame starts where a whole decode starts it.
  This is not exact, and cannot be made so at a bounded cost: each of the ODE's 36 DiT evaluations
  widens a frame's reach by the look-back / look-ahead blocks, so a frame depends on the whole
  utterance. The windows shrink that dependence to its near part (tested against a whole decode).
  The seeded generator is a CPU one whatever the device (the noise then moves to the model's device),
  so a seed starts the ODE from the same noise on a GPU as on the CPU.
- **BigVGAN.** Convolutional, with a receptive field bounded by its config (`vocoder_context_frames`:
  40 mel frames each side for the published model). A chunk vocodes its mel frames with that many
  frames of context on each side, so its samples equal a whole decode's up to float rounding; the
  last frames of a chunk wait for the next chunk's mel as their right context.

At the end of the stream everything left is decoded with no right context, as a whole decode ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omnistage.checkpoints.shards import ShardedCheckpoint
from stage_service.engines.qwen2_5_omni.steps import check_speaker, load_speakers, pieces
from stage_service.runtime.invariance import MIN_CONV_BATCH, make_batch_invariant, pad_rows
from stage_service.runtime.sampling import new_generator
from stage_service.runtime.scheduler import StepState

SAMPLE_RATE = 24000  # Qwen2.5-Omni speaks at 24 kHz: 240 samples per mel frame, 100 frames a second


@dataclass(frozen=True)
class Voice:
    name: str
    cond: torch.Tensor      # [1, enc_emb_dim] speaker embedding
    ref_mel: torch.Tensor   # [1, frames, mel_dim] reference mel the DiT's speaker encoder reads


@dataclass(eq=False)
class SpeechChunkState(StepState):
    """One chunk of one request: a DiT window of tokens and the vocoder window over the mel around it."""

    voice: Voice
    codes: torch.Tensor       # [w] tokens of the DiT window (empty: only vocoding is left)
    noise: torch.Tensor       # [w * repeats, mel_dim] the ODE's start at those positions
    keep: tuple[int, int]     # mel frames of the window's output that are new
    held_mel: torch.Tensor    # [h, mel_dim] mel frames made before, the vocoder's left context
    vocode: tuple[int, int]   # the vocoder window over held + new mel frames
    emit: tuple[int, int]     # frames of that window whose samples this chunk emits
    decoded_to: int           # tokens with mel once this chunk is done
    vocoded_to: int           # mel frames with audio once this chunk is done
    finished: bool = False

    @property
    def key(self) -> tuple[int, int, int]:  # equal shapes share a forward
        return len(self.codes), self.voice.ref_mel.shape[1], self.vocode[1] - self.vocode[0]

    @property
    def cost(self) -> int:  # codec tokens through the DiT, against the engine's max_batched_frames
        return max(len(self.codes), 1)

    def held_bytes(self) -> int:
        return self.codes.nbytes + self.noise.nbytes + self.held_mel.nbytes

    def release(self) -> None:
        self.codes = self.noise = self.held_mel = torch.empty(0)


class Token2Wav:
    """The Token2Wav part of a Qwen2.5-Omni checkpoint, decoding chunks of many requests in batches."""

    LEFT_BLOCKS = 2    # DiT blocks of earlier tokens in a chunk's window
    RIGHT_BLOCKS = 1   # DiT blocks of later tokens a chunk waits for
    # Qwen2_5OmniToken2WavModel.forward's defaults: ODE steps, classifier-free guidance, time sway.
    NUM_STEPS = 10
    GUIDANCE = 0.5
    SWAY = -1.0

    def __init__(self, ckpt: ShardedCheckpoint, config, batch_invariant: bool = True,
                 device: torch.device | str = "cpu"):
        (token2wav,) = pieces(config, "token2wav")  # float32, whatever the stage's dtype
        model = token2wav.load(ckpt, torch.float32, device)
        self.device = model.device
        if batch_invariant:
            make_batch_invariant(model)
        self.batch_invariant = batch_invariant
        self.dit, self.vocoder = model.code2wav_dit_model, model.code2wav_bigvgan_model
        dit = config.token2wav_config.dit_config
        self.repeats, self.mel_dim, self.codebook = dit.repeats, dit.mel_dim, dit.num_embeds + 1
        if dit.block_size % dit.repeats:
            raise ValueError(f"token2wav_config.dit_config.block_size {dit.block_size} is not a multiple of "
                             f"repeats {dit.repeats}")
        block = dit.block_size // dit.repeats
        self.left, self.right = self.LEFT_BLOCKS * block, self.RIGHT_BLOCKS * block
        self.block = block
        self.max_tokens = dit.max_position_embeddings // dit.repeats
        self.vocoder_context = vocoder_context_frames(config.token2wav_config.bigvgan_config)
        self.hop = math.prod(config.token2wav_config.bigvgan_config.upsample_rates)
        self.speakers = load_speakers(ckpt.root)
        self.sample_rate = SAMPLE_RATE

    def voice(self, speaker: str) -> Voice:
        s = check_speaker(self.speakers, speaker)
        return Voice(s["name"], s["cond"].to(self.device, torch.float32).reshape(1, -1),
                     s["ref_mel"].to(self.device, torch.float32).reshape(1, -1, self.mel_dim))

    def stream(self, voice: Voice, seed: int) -> "SpeechStream":
        return SpeechStream(self, voice, seed)

    @torch.inference_mode()
    def decode_batch(self, states: list[SpeechChunkState]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(new mel frames [n, mel_dim], waveform of the emitted frames) of chunks with equal keys."""
        if len(states[0].codes):
            mel = self.mel(torch.stack([st.codes for st in states]), torch.stack([st.noise for st in states]),
                           torch.cat([st.voice.cond for st in states]), torch.cat([st.voice.ref_mel for st in states]))
            new = [m[st.keep[0]:st.keep[1]] for m, st in zip(mel, states)]
        else:
            new = [torch.empty(0, self.mel_dim, device=self.device) for _ in states]
        windows = [torch.cat([st.held_mel, m])[st.vocode[0]:st.vocode[1]] for st, m in zip(states, new)]
        if len(windows[0]):
            wav = self.vocode(torch.stack(windows))
            pcm = [w[st.emit[0] * self.hop:st.emit[1] * self.hop] for w, st in zip(wav, states)]
        else:
            pcm = [torch.empty(0, device=self.device) for _ in states]
        for st in states:
            st.finished = True
        return list(zip(new, pcm))

    def mel(self, codes: torch.Tensor, noise: torch.Tensor, cond: torch.Tensor, ref_mel: torch.Tensor) -> torch.Tensor:
        """Mel frames [B, frames, mel_dim] of token windows [B, w], integrating the flow from `noise`, as
        Qwen2_5OmniToken2WavDiTModel.sample does from its own noise."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        speaker = cond.unsqueeze(1).repeat(1, noise.shape[1], 1)

        def velocity(t, x):
            out = self.dit(hidden_states=x, condition_vector=ref_mel, speaker_embedding=speaker, quantized_code=codes,
                           time_step=t, apply_cfg=True)
            guided, unguided = torch.chunk(out, 2, dim=0)
            return guided + (guided - unguided) * self.GUIDANCE

        t = torch.linspace(0, 1, self.NUM_STEPS, dtype=cond.dtype, device=cond.device)
        t = t + self.SWAY * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)[-1]

    def vocode(self, mel: torch.Tensor) -> torch.Tensor:
        """Waveforms [B, frames * hop] of mel windows [B, frames, mel_dim]."""
        n = len(mel)
        if self.batch_invariant:  # a 1-D convolution over a batch of 1 rounds differently (invariance.py)
            mel = pad_rows(mel, MIN_CONV_BATCH)
        return self.vocoder(mel.transpose(1, 2)).reshape(len(mel), -1)[:n]


def vocoder_context_frames(cfg) -> int:
    """Mel frames on either side of a frame that reach its samples through BigVGAN (its receptive radius),
    bounded from the config: a convolution reaches (kernel - 1) * dilation / 2 samples at its rate, an
    anti-aliased activation at most 6 (two 12-tap filters at twice the rate), a transposed convolution
    ceil(kernel / stride) input samples; a residual block's convolutions add up, parallel blocks take
    the widest."""
    act = 6
    radius, rate = 3.0, 1  # conv_pre: kernel 7
    for stride, kernel in zip(cfg.upsample_rates, cfg.upsample_kernel_sizes):
        radius += math.ceil(kernel / stride) / rate
        rate *= stride
        radius += max(sum(2 * act + (k - 1) * d / 2 + (k - 1) / 2 for d in dilations)
                      for k, dilations in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)) / rate
    radius += (act + 3) / rate  # activation_post, conv_post (kernel 7)
    return math.ceil(radius) + 1


class SpeechStream:
    """One request's codec tokens on their way to audio: what has arrived, what has mel, what has audio.
    Pure bookkeeping on the event loop; the model work is in the `SpeechChunkState`s it hands out. Its
    codes, noise and mel live on the model's device; the noise is drawn on the CPU (module docstring)."""

    def __init__(self, t2w: Token2Wav, voice: Voice, seed: int):
        self.t2w, self.voice = t2w, voice
        self.generator = new_generator(seed)  # on the CPU whatever the device: see the module docstring
        self.base = 0                     # token index of codes[0] (older tokens are no window's any more)
        self.codes = torch.empty(0, dtype=torch.int64, device=t2w.device)
        self.noise = torch.empty(0, t2w.mel_dim, device=t2w.device)  # from mel frame base * repeats on
        self.arrived = self.decoded = 0   # tokens
        self.mel_base = 0                 # mel frame index of mel[0]
        # mel frames mel_base .. repeats * decoded, kept as context
        self.mel = torch.empty(0, t2w.mel_dim, device=t2w.device)
        self.vocoded = 0                  # mel frames
        self.ended = False

    def add(self, codes: torch.Tensor, ended: bool = False) -> None:
        """Tokens [n] that arrived (in order), and whether the stream ended with them."""
        r = self.t2w.repeats
        if self.arrived + len(codes) > self.t2w.max_tokens:
            raise ValueError(f"{self.arrived + len(codes)} codec tokens exceed the DiT's "
                             f"{self.t2w.max_tokens} (max_position_embeddings / repeats)")
        self.codes = torch.cat([self.codes, codes.to(self.codes.device, torch.int64)])
        noise = torch.randn(len(codes) * r, self.t2w.mel_dim, generator=self.generator)
        self.noise = torch.cat([self.noise, noise.to(self.noise.device)])
        self.arrived += len(codes)
        self.ended = self.ended or ended

    def next_chunk(self) -> SpeechChunkState | None:
        """The work that what has arrived allows (None: wait for more tokens)."""
        t, r, ctx = self.t2w, self.t2w.repeats, self.t2w.vocoder_context
        a, n = self.decoded, self.arrived
        b = n if self.ended else a + max(0, (n - t.right - a) // t.block) * t.block
        mel_end = r * b
        v0 = self.vocoded
        v1 = mel_end if self.ended else max(v0, mel_end - ctx)
        if b == a and v1 == v0:
            return None
        w0, w1 = (max(0, a - t.left), min(n, b + t.right)) if b > a else (a, a)
        vs, ve = (max(0, v0 - ctx), min(mel_end, v1 + ctx)) if v1 > v0 else (v0, v0)  # no frame to emit: none
        return SpeechChunkState(
            voice=self.voice, codes=self.codes[w0 - self.base:w1 - self.base].clone(),
            noise=self.noise[r * (w0 - self.base):r * (w1 - self.base)].clone(),
            keep=(r * (a - w0), r * (b - w0)), held_mel=self.mel.clone(),
            vocode=(vs - self.mel_base, ve - self.mel_base), emit=(v0 - vs, v1 - vs), decoded_to=b, vocoded_to=v1)

    def done(self, chunk: SpeechChunkState, new_mel: torch.Tensor) -> None:
        """Record a decoded chunk and drop what no later window needs."""
        t, r = self.t2w, self.t2w.repeats
        self.mel = torch.cat([self.mel, new_mel])  # mel frames mel_base .. repeats * decoded_to
        self.decoded, self.vocoded = chunk.decoded_to, chunk.vocoded_to
        keep_mel = max(0, self.vocoded - t.vocoder_context)
        self.mel, self.mel_base = self.mel[keep_mel - self.mel_base:], keep_mel
        keep_tokens = max(0, self.decoded - t.left)
        self.codes = self.codes[keep_tokens - self.base:]
        self.noise = self.noise[r * (keep_tokens - self.base):]
        self.base = keep_tokens
