"""Byte-level BPE tokenizers trained locally on a small fixed corpus.

`train_bpe` / `pad_vocab` make plain byte-level BPE tokenizers; `qwen_tokenizer` makes one the way Qwen
checkpoints ship theirs (`Qwen2Tokenizer`: Qwen's pre-tokenizer, NFC, the role words and special tokens
at the ids the model config names), saved with `save_qwen_tokenizer` as tokenizer.json plus vocab.json
and merges.txt.
"""

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

SCORE_DIGITS = 6  # the Unigram scores kept: far above the trainer's run-to-run noise, far below their gaps

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
    _fill(vocab, size, {**fixed, **specials})
    out = Tokenizer.from_str(json.dumps(data))
    from tokenizers import AddedToken

    out.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())])
    return out


def _fill(vocab: dict[str, int], size: int, wanted: dict[int, str]) -> None:
    """Give every free id below `size` its `wanted` token, else a pseudo-word (in place)."""
    rng = random.Random(0)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    taken = set(vocab.values())
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


def qwen_tokenizer(size: int, words: dict[int, str], specials: dict[int, str],
                   not_special: frozenset[str] = frozenset(), texts: tuple[str, ...] = (), **roles: str):
    """A transformers `Qwen2Tokenizer` as Qwen checkpoints ship it.

    `size` regular ids: the BPE trained on CORPUS, each of `words` ("user", "assistant": the role names
    a chat template writes) a single token at the id the model config names, pseudo-words elsewhere;
    then the added tokens `specials` at their ids, which must follow on from `size` (special unless in
    `not_special`, as Qwen marks `<think>` or `<tool_call>`). `texts`: more training lines, each word of which
    then trains into one token, as the published vocabulary has it (a prompt template whose token count a
    pipeline relies on). `roles` are the tokenizer's named tokens (eos_token, pad_token, audio_token, ...), as
    its tokenizer_config.json lists them.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    assert sorted(specials) == list(range(size, size + len(specials))), "added tokens must follow the vocab"
    trained = _qwen_backend(models.BPE())
    # Each role word as its own line, so training merges it into one token.
    trainer = trainers.BpeTrainer(vocab_size=min(words), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(CORPUS * 20 + list(words.values()) * 50 + list(texts) * 50, trainer)
    data = json.loads(trained.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for i, word in words.items():
        assert trained.encode(word).tokens == [word], f"{word!r} did not train into one token"
        del vocab[word]
    assert not set(vocab.values()) & set(words), "trained vocab overlaps the role words' ids"
    vocab.update({w: i for i, w in words.items()})
    _fill(vocab, size, {})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]]
    backend = _qwen_backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.add_special_tokens([AddedToken(t, special=t not in not_special, normalized=False)
                                for _, t in sorted(specials.items())])
    assert all(backend.token_to_id(t) == i for i, t in specials.items())
    named = {"unk_token": None, "bos_token": None,  # Qwen has neither
             **{k: v for k, v in roles.items() if k in ("eos_token", "pad_token", "bos_token", "unk_token")}}
    extra = {k: v for k, v in roles.items() if k not in named}
    return Qwen2Tokenizer(tokenizer_object=backend, extra_special_tokens=extra or None, **named)


def _qwen_backend(model) -> Tokenizer:
    from tokenizers import Regex, normalizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def save_qwen_tokenizer(tok, out) -> None:
    """tokenizer.json and tokenizer_config.json (transformers), plus vocab.json and merges.txt, which Qwen
    checkpoints ship beside them (the regular vocabulary only: added tokens live in tokenizer.json)."""
    from pathlib import Path

    out = Path(out)
    tok.save_pretrained(out)
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    (out / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def t5_tokenizer(specials: list[str], vocab_size: int = 300):
    """A transformers T5Tokenizer (sentencepiece-style Unigram, Metaspace pre-tokenizer) trained on CORPUS, with
    `specials` at the first ids (`<pad>`, `</s>`, ... as the model's tokenizer numbers them)."""
    from transformers import T5Tokenizer

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.train_from_iterator(CORPUS * 20, trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>", show_progress=False))
    trained = [tuple(v) for v in json.loads(unigram.to_str())["model"]["vocab"]]
    assert [v[0] for v in trained[:len(specials)]] == specials, "special tokens must keep the model's ids"
    # The trainer's scores differ between runs in their last bits (~1e-14), which reorders pieces of equal
    # score: rounded, and ties put in the pieces' order, every build is the same tokenizer.
    pieces = sorted(((piece, round(score, SCORE_DIGITS)) for piece, score in trained[len(specials):]),
                    key=lambda v: (-v[1], v[0]))
    vocab = [*trained[:len(specials)], *pieces]
    return T5Tokenizer(vocab=vocab, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)
