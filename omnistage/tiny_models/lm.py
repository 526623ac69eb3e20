"""A tiny Qwen2 causal LM with a locally trained tokenizer: vLLM and transformers both serve it.

Saved as Qwen2 checkpoints are published: config.json, generation_config.json, the weights in two
shards with `model.safetensors.index.json`, a fast tokenizer with its chat template."""

from __future__ import annotations

from pathlib import Path

SHARD_BYTES = 6_000_000  # ~9.5 MB of weights: two shards, as published checkpoints are split


def build(out: Path, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from omnistage.tiny_models.tokenizers_local import train_bpe

    tok = train_bpe(512, ["<unk>", "<s>", "</s>", "<pad>"])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>")
    hf_tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    cfg = AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                               bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=True,
                               dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=SHARD_BYTES)
    hf_tok.save_pretrained(out)
