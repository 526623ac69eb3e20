"""Image edits (`/v1/images/edits`, OpenAI's shape; pure): the image to edit and the edit as the prompt -> one
request per image made (`n`), each carrying the image as its one image part beside the prompt, answered as
`/v1/images/generations` is (images.py). The media check at the door decodes the image as any image part.

The body is multipart/form-data as the openai SDK sends it: `image` (one file; a list of files comes as `image[]`),
`prompt`, `mask`, `n`, `size`, `response_format`, `output_format`, `model`, and omnistage's `seed`,
`num_inference_steps`, `guidance_scale`, `negative_prompt`; or JSON with the image inline: `image` (a data: URL or
{"image_url": "data:..."}, or a list of them) or OpenAI's `images` (a list of {"image_url": ...}).

A pipeline edits when it makes images from exactly one image a request carries (a stage that reads it, as FLUX.1
Kontext's VAE encoder stage); any other is refused naming it. A mask is refused by name: no editing family served
reads one (FLUX.1 Kontext edits the whole image as the prompt says).
"""

from __future__ import annotations

from typing import Any

from omnistage.api import Pipeline, one_of_each_input
from omnistage.contract.params import InvalidRequest
from omnistage.v1 import common_pb2

from . import multipart_form
from .schemas import ImageEditRequest, ImageReference
from .translate import Translated, check_model, images, inline_image, pipeline_outputs

IMAGE = "image"  # the body's field for the image to edit (`image[]` for a list, as the SDK sends one)


def edits(body: ImageEditRequest, pipeline: Pipeline, sent: list[tuple[Any, str]], mask: bool) -> list[Translated]:
    """The edit's requests: `sent` the images to edit as they came (files' bytes, data: URLs, reference objects),
    each with the body's field a refusal of it names; `mask` whether a mask came."""
    check_model(body.model, pipeline)
    if "image" not in pipeline_outputs(pipeline) or "image" not in one_of_each_input(pipeline):
        makes = "makes no images" if "image" not in pipeline_outputs(pipeline) else \
            "makes images from a prompt alone (POST /v1/images/generations)"
        raise InvalidRequest("model", f'"{pipeline.name}" does not edit images: it {makes}')
    if mask:
        raise InvalidRequest("mask", f'is not served: "{pipeline.name}" edits the whole image as the prompt says '
                                     "(FLUX.1 Kontext reads no mask); send the image and the prompt alone")
    if len(sent) != 1:
        raise InvalidRequest(IMAGE, f'"{pipeline.name}" edits one image: send exactly one, got {len(sent)}')
    value, field = sent[0]
    if isinstance(value, ImageReference):
        value = value.model_dump(exclude_none=True)
    part = common_pb2.ContentPart(image=common_pb2.ImagePart(data=inline_image(value, field)))
    return images(body, pipeline, parts=[part], parts_field=field)


def from_json(body: ImageEditRequest, pipeline: Pipeline) -> list[Translated]:
    """A JSON body's edit (`image`, or OpenAI's `images`)."""
    given: list[Any] = [] if body.image in (None, "") else body.image if isinstance(body.image, list) else [body.image]
    sent = [(v, IMAGE if len(given) == 1 else f"{IMAGE}[{i}]") for i, v in enumerate(given)]
    sent += [(v, f"images[{i}]") for i, v in enumerate(body.images or ())]
    return edits(body, pipeline, sent, body.mask not in (None, ""))


def from_upload(raw: bytes, content_type: str, pipeline: Pipeline) -> list[Translated]:
    """A multipart body's edit: its text fields read as the JSON body's, its files (`image`, `image[]`, `mask`)."""
    form = multipart_form.parse(raw, content_type)
    files = (IMAGE, f"{IMAGE}[]", "mask")
    fields: dict[str, Any] = {name: form.text(name) for name in form.fields if name not in files}
    body = ImageEditRequest.model_validate(fields)
    sent: list[tuple[Any, str]] = [(f.data, name) for name in (IMAGE, f"{IMAGE}[]") for f in form.files.get(name, [])]
    sent += [(t, IMAGE) for t in form.texts(IMAGE)]  # an image sent as a data: URL in a text field
    mask = bool(form.files.get("mask")) or bool(form.text("mask"))
    return edits(body, pipeline, sent, mask)
