"""Byte-level BPE tokenizers trained locally on a small fixed corpus."""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer trained on the spot.",
    "Multi-stage inference: thinker, talker, code2wav.",
    "Diffusion models denoise latents with a UNet or a transformer.",
    "gRPC services move tensors over UCX between stages.",
    "a photo of a cat sitting on a red car on a road",
    "an astronaut riding a horse on the moon",
    "Tell me a short story about the sea and the wind.",
    "What is the weather like today? It is sunny and warm.",
    "Kubernetes schedules pods; each stage scales on its own.",
]

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def train_bpe(vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=special_tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def pad_vocab(tok: Tokenizer, size: int, fixed: dict[int, str], specials: dict[int, str]) -> Tokenizer:
    """Grow a trained BPE vocabulary to `size` ids.

    `fixed` places plain tokens at given ids (e.g. "user" where the model config
    expects it) and `specials` places special tokens; every other new id gets a
    pronounceable pseudo-word, so text decoded from a random-weight model reads
    as words rather than bytes. Merges are untouched, so encoding is unchanged.
    """
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab.values())
    assert not taken & set(fixed) and not taken & set(specials), "trained vocab overlaps fixed ids"
    wanted = {i: t for i, t in {**fixed, **specials}.items()}
    rng = random.Random(0)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    used = set(vocab)
    for i in range(size):
        if i in taken:
            continue
        if i in wanted:
            word = wanted[i]
        else:
            while True:
                word = "\u0120" + "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
                if word not in used:
                    break
        used.add(word)
        vocab[word] = i
    out = Tokenizer.from_str(json.dumps(data))
    from tokenizers import AddedToken

    out.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())])
    return out
