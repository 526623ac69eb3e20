"""Images (`/v1/images/generations`): one call per image, all at once through the same request path
(each admitted on its own), the PNGs as `b64_json`."""

from __future__ import annotations

import time

from omnistage.v1 import orchestrator_pb2

from .call import Call, run_all
from .errors import ApiError
from .responses import TRACE_FIELD, b64encode_str, trace_dict


async def _image(call: Call) -> tuple[orchestrator_pb2.ImageOutput, orchestrator_pb2.Final | None]:
    """The call's image and its final event; a run that ends without an image is a server error (the
    request path asked for one)."""
    image, final = None, None
    async for ev in call:
        kind = ev.WhichOneof("event")
        if kind == "image":
            image = ev.image
        elif kind == "final":
            final = ev.final
    if image is None:
        raise ApiError(500, f"request {call.request_id}: the pipeline produced no image", "server_error")
    return image, final


async def generate(calls: list[Call]) -> dict:
    made = await run_all(calls, _image)
    body = {"created": int(time.time()), "data": [{"b64_json": b64encode_str(image.png)} for image, _ in made],
            "output_format": "png"}
    if made and made[0][0].width:
        body["size"] = f"{made[0][0].width}x{made[0][0].height}"
    traces = [trace_dict(final) for _, final in made]
    if any(t is not None for t in traces):  # one per image, in order
        body[TRACE_FIELD] = traces
    return body
