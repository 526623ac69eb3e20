"""A Generate request as the orchestrator takes it: the one builder every caller uses (the client SDK, the
HTTP door's translations, tests and benchmarks), so each front door asks for work in the same shape.

Unset numbers stay 0 (or unset, for the optional ones): the orchestrator resolves them against the
pipeline's limits (`omnistage.contract.params.resolve`).
"""

from __future__ import annotations

from typing import Iterable

from omnistage.contract.modalities import MODALITY_CODES
from omnistage.v1 import common_pb2, orchestrator_pb2


def build_request(prompt: str = "", *, prompt_token_ids: Iterable[int] = (), system_prompt: str = "",
                  raw_prompt: bool = False, max_tokens: int = 0,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, ignore_eos: bool = False, max_codec_frames: int = 0, speaker: str = "",
                  width: int = 0, height: int = 0, num_inference_steps: int = 0, guidance_scale: float | None = None,
                  negative_prompt: str = "", true_cfg_scale: float = 0.0, num_frames: int = 0, fps: int = 0,
                  outputs: Iterable[str] = (),
                  return_trace: bool = False, priority: int = 0, request_id: str = "",
                  parts: Iterable[common_pb2.ContentPart | str] = (), turns: Iterable[common_pb2.Turn] = (),
                  tools: Iterable[common_pb2.Tool] = (), answer_prefix: str = "",
                  language: str = "", instructions: str = "",
                  ref_text: str = "") -> orchestrator_pb2.GenerateRequest:
    """One Generate request. `parts`: the user turn as ordered content parts (a str is a text part); a
    `prompt` with them is one more text part after them. With `turns`, `parts` is a conversation instead:
    each turn takes the next `Turn.parts` of them (`omnistage.contract.conversation`)."""
    text = common_pb2.TextParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    if temperature is not None:
        text.temperature = temperature
    if top_p is not None:
        text.top_p = top_p
    if top_k is not None:
        text.top_k = top_k
    image = common_pb2.ImageParams(width=width, height=height, num_inference_steps=num_inference_steps,
                                   negative_prompt=negative_prompt, true_cfg_scale=true_cfg_scale)
    if guidance_scale is not None:
        image.guidance_scale = guidance_scale
    params = common_pb2.GenerationParams(prompt=prompt, prompt_token_ids=list(prompt_token_ids), text=text,
                                         audio=common_pb2.AudioParams(max_codec_frames=max_codec_frames,
                                                                      speaker=speaker, language=language,
                                                                      instructions=instructions,
                                                                      ref_text=ref_text),
                                         image=image,
                                         video=common_pb2.VideoParams(num_frames=num_frames, fps=fps),
                                         system_prompt=system_prompt, raw_prompt=raw_prompt,
                                         parts=[_part(p) for p in parts], turns=list(turns), tools=list(tools),
                                         answer_prefix=answer_prefix)
    if seed is not None:
        params.seed = seed
    unknown = [o for o in outputs if o not in MODALITY_CODES]
    if unknown:
        raise ValueError(f"unknown output modality {unknown[0]!r} (use {', '.join(MODALITY_CODES)})")
    return orchestrator_pb2.GenerateRequest(request_id=request_id, params=params,
                                            outputs=[MODALITY_CODES[o] for o in outputs],
                                            return_trace=return_trace, priority=priority)


def _part(p: common_pb2.ContentPart | str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(text=p) if isinstance(p, str) else p
