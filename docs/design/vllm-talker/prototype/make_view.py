import json, os, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
full = json.loads((src / "config.json").read_text())
tk = full["talker_config"]; t = tk["text_config"]
cfg = dict(architectures=["TalkerProto"], model_type="qwen3_moe", vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
           intermediate_size=t["intermediate_size"], num_hidden_layers=t["num_hidden_layers"],
           num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
           moe_intermediate_size=t["moe_intermediate_size"], num_experts=t.get("num_experts", t.get("num_local_experts")),
           num_experts_per_tok=t["num_experts_per_tok"], norm_topk_prob=t["norm_topk_prob"], decoder_sparse_step=1,
           mlp_only_layers=[], shared_expert_intermediate_size=t["shared_expert_intermediate_size"],
           rms_norm_eps=t["rms_norm_eps"], hidden_act=t["hidden_act"], attention_bias=False,
           rope_parameters={"rope_type": "default", "rope_theta": t["rope_parameters"]["rope_theta"]},
           max_position_embeddings=t["max_position_embeddings"], tie_word_embeddings=False, torch_dtype="float32",
           code_predictor_config=tk["code_predictor_config"], codec_eos_token_id=tk["codec_eos_token_id"])
(dst / "config.json").write_text(json.dumps(cfg, indent=1))
for f in src.iterdir():
    if f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json":
        if not (dst / f.name).exists():
            os.symlink(f, dst / f.name)
