"""Tiny Qwen3-TTS CustomVoice and Base (12 Hz), written as Qwen publishes Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice
and -Base and saved by the qwen-tts package's own classes: `config.json` (`Qwen3TTSForConditionalGeneration` /
`qwen3_tts`: the talker with its code predictor, its named speakers `talker_config.spk_id` and languages
`codec_language_id`), `model.safetensors`, `generation_config.json` (the sampling defaults qwen-tts reads), the
Qwen2 tokenizer (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json) with the processor's settings, and
the 12 Hz speech tokenizer in `speech_tokenizer/` (its own config.json, model.safetensors and
preprocessor_config.json: a Mimi encoder and the decoder that turns 12.5 Hz codec frames into 24 kHz audio,
1920 samples a frame).

The codec ids keep upstream's layout: 2048 codes per group, the talker's specials above them (a vocabulary of
3072 whose top 1024 rows `generate` suppresses, the end-of-speech code aside); the tokenizer is the tiny
Qwen3-Omni one (the text ids, `<tts_pad>` and friends at upstream's ids).

The Base checkpoint (`build_base`, voice cloning) differs as upstream's does: `tts_model_type` "base", no named
speakers (`spk_id` and `spk_is_dialect` empty), and a speaker encoder (`speaker_encoder_config`, tensors under
`speaker_encoder.`: an ECAPA-TDNN over a clip's 128-bin mel spectrogram, giving one row of the talker's width).
Its speech tokenizer is the same, its encoder's codebooks drawn so a reference clip's codes vary.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.tiny_models import qwen3_omni

HIDDEN = 32
TEXT_VOCAB = 151936  # the talker's text embedding rows, as upstream
CODEBOOK = 2048      # codes per group (the speech tokenizer's codebook)
GROUPS = 4           # code groups per frame (upstream: 16); the talker's first, its code predictor's the rest
CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154,
                 codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
LANGUAGES = {"chinese": 2055, "english": 2050, "beijing_dialect": 2074}
# Named speakers (the CustomVoice checkpoint's voices), their codec ids, and the dialect one speaks.
SPEAKERS = {"vivian": 3065, "ryan": 3061, "dylan": 2878}
DIALECTS = {"vivian": False, "ryan": False, "dylan": "beijing_dialect"}
# The sampling defaults upstream's generation_config.json gives (qwen-tts reads them as generate's defaults).
GENERATION = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                  subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9,
                  max_new_tokens=8192)
# Weights drawn wider than the package's 0.02: at 0.02 the tiny talker says the same code whatever it reads;
# at this scale its codes depend on the text and the voice, so tests comparing them can tell requests apart.
INIT_RANGE = 0.3
OUTPUT_GAIN = 0.01  # the tiny codec decoder's last convolution, scaled so its waveform lies mostly within [-1, 1]
# The tiny speaker encoder's last layer, scaled so the speaker row it gives is of the size of the talker's codec
# rows (drawn as the package draws it, a clip's row is some 500 times larger and drowns the rows beside it).
SPEAKER_GAIN = 0.002


# The speaker encoder at toy size (upstream: channels 512 x 4 and 1536, enc_dim the talker's width).
SPEAKER_ENCODER = dict(mel_dim=128, enc_dim=HIDDEN, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                       enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=4,
                       enc_se_channels=8, sample_rate=24000)
CUSTOM_VOICE, BASE = "custom_voice", "base"


def config_dict(kind: str = CUSTOM_VOICE) -> dict:
    """config.json as published (the package's own keys; transformers 5 would write its sub-configs otherwise)
    for a CustomVoice or a Base checkpoint."""
    base = kind == BASE
    small = dict(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 initializer_range=INIT_RANGE, max_position_embeddings=32768, rope_theta=1000000, rms_norm_eps=1e-6,
                 hidden_act="silu")
    talker = dict(small, vocab_size=3072, num_hidden_layers=2, num_code_groups=GROUPS, text_hidden_size=HIDDEN,
                  text_vocab_size=TEXT_VOCAB, spk_id={} if base else SPEAKERS, spk_is_dialect={} if base else DIALECTS,
                  codec_language_id=LANGUAGES,
                  rope_scaling={"mrope_section": [1, 1, 2], "interleaved": True, "rope_type": "default"},
                  code_predictor_config=dict(small, vocab_size=CODEBOOK, num_hidden_layers=1, num_code_groups=GROUPS),
                  **CODEC_IDS)
    ids = qwen3_omni.TOKEN_IDS
    return dict(architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts", talker_config=talker,
                speaker_encoder_config=SPEAKER_ENCODER if base else dict(enc_dim=HIDDEN),
                tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="1b7", tts_model_type=kind,
                im_start_token_id=ids["<|im_start|>"],
                im_end_token_id=ids["<|im_end|>"], tts_pad_token_id=ids["<tts_pad>"],
                tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"],
                assistant_token_id=qwen3_omni.ROLE_IDS["assistant"], initializer_range=INIT_RANGE)


def codec_config_dict() -> dict:
    """speech_tokenizer/config.json as published."""
    # Mimi's encoder at 24 kHz, 12.5 frames a second; the decoder upsamples a frame 8*5*4*3*2*2 = 1920 times.
    encoder = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                   intermediate_size=64, codebook_size=CODEBOOK, codebook_dim=16,
                   vector_quantization_hidden_dimension=16, num_filters=4,
                   upsampling_ratios=[8, 6, 5, 4], upsample_groups=HIDDEN, num_quantizers=GROUPS,
                   num_semantic_quantizers=1, sliding_window=16, frame_rate=12.5, sampling_rate=24000)
    decoder = dict(codebook_size=CODEBOOK, hidden_size=HIDDEN, latent_dim=HIDDEN, codebook_dim=16,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=64, num_hidden_layers=1,
                   num_quantizers=GROUPS, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=32,
                   sliding_window=8)
    return dict(architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz",
                encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=GROUPS,
                input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920,
                encode_downsample_rate=1920)


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def build_base(out: Path, seed: int = 0) -> None:
    """The tiny Base checkpoint (voice cloning from a reference clip)."""
    build(out, seed, BASE)


def build(out: Path, seed: int = 0, kind: str = CUSTOM_VOICE) -> None:
    import torch
    from transformers import EncodecFeatureExtractor

    from omnistage.checkpoints.qwen_tts import SPEECH_TOKENIZER_DIR, classes, with_pad_token
    from omnistage.tiny_models.tokenizers_local import save_qwen_tokenizer

    qt = classes()
    torch.manual_seed(seed)
    published = config_dict(kind)
    model = qt.model(with_pad_token(qt.config(**_without(published, "architectures", "model_type")))).eval()
    if model.speaker_encoder is not None:
        with torch.no_grad():
            model.speaker_encoder.fc.weight.mul_(SPEAKER_GAIN)
            model.speaker_encoder.fc.bias.mul_(SPEAKER_GAIN)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(published, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    tok = qwen3_omni.tokenizer()
    save_qwen_tokenizer(tok, out)
    qt.processor(tokenizer=tok).save_pretrained(out)
    torch.manual_seed(seed + 1)
    codec_published = codec_config_dict()
    codec = qt.codec(qt.codec_config(**_without(codec_published, "architectures", "model_type"))).eval()
    # The decoder's codebooks start at zero (a trained codec fills them) and its convolutions at 0.02, which
    # over a dozen layers leaves no sound: codebooks drawn, and each convolution at 1 / sqrt(fan in), so the
    # tiny decoder's waveform neither vanishes nor clips.
    with torch.no_grad():
        for name, param in codec.decoder.named_parameters():
            if name.endswith("_codebook.embedding_sum"):
                param.normal_(0.0, 1.0)
        for module in codec.decoder.modules():
            if isinstance(module, torch.nn.Conv1d):  # weight [out, in / groups, kernel]
                module.weight.normal_(0.0, (module.weight.shape[1] * module.weight.shape[2]) ** -0.5)
            elif isinstance(module, torch.nn.ConvTranspose1d):  # weight [in, out, kernel], kernel / stride taps
                taps = module.weight.shape[0] * module.weight.shape[2] // module.stride[0]
                module.weight.normal_(0.0, taps ** -0.5)
        codec.decoder.decoder[-1].conv.weight.mul_(OUTPUT_GAIN)  # the residual blocks grow it: back below 1
        if kind == BASE:  # a reference clip's codes: the encoder's codebooks drawn too (zero: every code the same)
            for name, buffer in codec.encoder.named_buffers():
                if name.endswith("codebook.embed_sum"):
                    buffer.normal_(0.0, 1.0)
    codec_dir = out / SPEECH_TOKENIZER_DIR
    codec.save_pretrained(codec_dir)
    (codec_dir / "config.json").write_text(json.dumps(codec_published, indent=2) + "\n")
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(codec_dir)
