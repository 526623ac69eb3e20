"""A video whose seconds per grid are extreme (timestamps spanning 1e20 s, sent to a stage that does not
check them) makes the model's rotary positions overflow to INT64_MIN: the Thinker refuses the prompt
(InputError, INVALID_ARGUMENT) instead of serving garbage (transformers) or indexing its rotary cache out
of range (vLLM). Both paths compute positions with `prompt_rows`, the real Thinker model's own
`get_rope_index` and its weightless stand-in for vLLM."""

from __future__ import annotations

import pytest
import torch

from stage_service.engines.omni.media import EncodedPrompt, prompt_rows
from stage_service.engines.vllm.media import PositionsOnly
from stage_service.engines.vllm.thinker import FAMILIES
from stage_service.runtime.errors import InputError


def video_prompt(cfg, second_per_grid: float) -> EncodedPrompt:
    start, end, video_id = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id
    ids = [1, 2, start] + [video_id] * 4 + [end, 4, 5]  # a video of 2x2x4 patches: 4 rows after the merge
    hidden = cfg.text_config.hidden_size
    enc = EncodedPrompt(ids=torch.tensor(ids), video=torch.zeros(4, hidden), video_grid_thw=torch.tensor([[2, 2, 4]]),
                        video_second_per_grid=torch.tensor([second_per_grid]))
    if hasattr(cfg.vision_config, "deepstack_visual_indexes"):
        enc.video_deepstack = torch.zeros(len(cfg.vision_config.deepstack_visual_indexes), 4, hidden)
    return enc


@pytest.mark.parametrize("model,family", [("qwen3-omni-tiny", "qwen3_omni"), ("qwen2.5-omni-tiny", "qwen2_5_omni")])
def test_positions_that_overflow_below_zero_are_refused_on_both_thinker_paths(model_dir, model, family):
    from stage_service.runtime.components import read_config

    config_cls, thinker_cls = FAMILIES[family].transformers_classes()
    cfg = read_config(model_dir / model, config_cls).thinker_config
    for thinker in (thinker_cls._from_config(cfg).eval(), PositionsOnly(thinker_cls, cfg)):
        assert int(prompt_rows(thinker, video_prompt(cfg, 1.0)).positions.min()) == 0
        for seconds in (7e19, 3e38, float("inf")):  # [0, 1, 2, 1e20] s at 2 frames per grid, and beyond
            with pytest.raises(InputError, match=r"the prompt's multimodal positions run from \S+ to \S+ \(the "
                                                 r"limits are 0 and 2147483647\): the video's timestamps or grids "
                                                 r"are out of range"):
                prompt_rows(thinker, video_prompt(cfg, seconds))
