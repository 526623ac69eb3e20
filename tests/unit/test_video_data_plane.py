"""An output stage's `video` frames reach the orchestrator inline even when the stage also feeds consumer
stages: the client's frames are read out of the chunk itself (OutputAssembler), never fetched by reference."""

from __future__ import annotations

import torch

from omnistage.contract.launch import ENV_TRANSPORTS
from omnistage.v1 import stage_pb2
from stage_service.data_plane import DataPlane

from ..harness import example

# Big enough that an `auto` edge would hold it in shared memory rather than inline (the connector's
# inline threshold is far below a megabyte).
FRAMES = (4, 256, 256, 3)


async def test_video_frames_go_inline_to_the_client_while_other_tensors_go_by_reference():
    p = example("wan-t2v-tiny")
    plane = DataPlane(p, p.stage("vae-decode"), env={ENV_TRANSPORTS: "shm"})
    await plane.start()
    try:
        # No engine reads frames yet: the consumer is named only for the data plane's choice of transport.
        header = stage_pb2.StageRequestHeader(request_id="r1", inline_outputs=True, consumers=["denoise"])
        out = await plane.outputs(header, 0, {"video": torch.zeros(FRAMES, dtype=torch.uint8),
                                              "latents": torch.zeros(1 << 18)})
        payload = {t.name: t.WhichOneof("payload") for t in out}
        assert payload == {"video": "data", "latents": "ref"}
        video = next(t for t in out if t.name == "video")
        assert len(video.data) == torch.Size(FRAMES).numel()
    finally:
        await plane.close()
