"""`/v1/images/edits` bodies -> GenerateRequests (orchestrator_service/http_api/image_edits.py), pure: the multipart
body exactly as the openai SDK encodes it and the JSON body with the image inline become one request per image,
each with the image as its one image part beside the prompt; every refusal names its field."""

from __future__ import annotations

import base64

import httpx
import pytest

from omnistage.api import load_pipeline
from omnistage.contract.params import InvalidRequest
from orchestrator_service.http_api import image_edits
from orchestrator_service.http_api.errors import openai_param
from orchestrator_service.http_api.schemas import ImageEditRequest

from ..conftest import EXAMPLES

KONTEXT = load_pipeline(EXAMPLES / "flux-kontext-tiny.yaml")
FLUX = load_pipeline(EXAMPLES / "flux-tiny.yaml")
WAN_I2V = load_pipeline(EXAMPLES / "wan-i2v-tiny.yaml")
PNG = b"\x89PNG not decoded here: the media check decodes it"
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def sdk_form(files: list[tuple[str, tuple]], **data) -> tuple[bytes, str]:
    """A multipart body as httpx (under the openai SDK) encodes `images.edit(...)`'s: its bytes and Content-Type."""
    request = httpx.Request("POST", "http://127.0.0.1/v1/images/edits", files=files,
                            data={k: str(v) for k, v in data.items()})
    return request.read(), request.headers["content-type"]


def uploaded(files, pipeline=KONTEXT, **data):
    return image_edits.from_upload(*sdk_form(files, **{"prompt": "make it red", **data}), pipeline)


def as_json(pipeline=KONTEXT, **kw):
    return image_edits.from_json(ImageEditRequest.model_validate({"prompt": "make it red", **kw}), pipeline)


def test_an_uploaded_image_is_each_requests_one_image_part():
    plans = uploaded([("image", ("in.png", PNG, "image/png"))], n=2, size="48x32", seed=7, num_inference_steps=3,
                     guidance_scale=2.5, response_format="b64_json", model=KONTEXT.name)
    assert [p.request.params.seed for p in plans] == [7, 8]
    for plan in plans:
        params = plan.request.params
        assert [p.WhichOneof("part") for p in params.parts] == ["image"]
        assert params.parts[0].image.data == PNG and params.prompt == "make it red"
        assert (params.image.width, params.image.height, params.image.num_inference_steps) == (48, 32, 3)
        assert params.image.guidance_scale == 2.5
    # a refusal of the part (the media check's) names the field it came in
    fields = plans[0].fields
    assert openai_param("params.parts[0].image", fields) == "image" and openai_param("params.parts", fields) == "image"
    assert openai_param("params.prompt", fields) == "prompt"


@pytest.mark.parametrize("body", [{"image": PNG_URL}, {"image": {"image_url": PNG_URL}}, {"image": [PNG_URL]},
                                  {"images": [{"image_url": PNG_URL}]}], ids=["data-url", "object", "list", "images"])
def test_a_json_body_takes_the_image_inline(body):
    (plan,) = as_json(**body)
    assert plan.request.params.parts[0].image.data == PNG


def test_a_list_of_one_uploaded_as_image_brackets_is_the_one_image():
    (plan,) = uploaded([("image[]", ("in.png", PNG, "image/png"))])
    assert plan.request.params.parts[0].image.data == PNG


REFUSALS = [
    (lambda: uploaded([]), "image", "edits one image: send exactly one, got 0"),
    (lambda: uploaded([("image[]", ("a.png", PNG, "image/png")), ("image[]", ("b.png", PNG, "image/png"))]),
     "image", "edits one image: send exactly one, got 2"),
    (lambda: uploaded([("image", ("a.png", PNG, "image/png")), ("mask", ("m.png", PNG, "image/png"))]), "mask",
     "(FLUX.1 Kontext reads no mask)"),
    (lambda: as_json(image=PNG_URL, mask=PNG_URL), "mask", "is not served"),
    (lambda: as_json(), "image", "got 0"),
    (lambda: as_json(image="https://example.com/a.png"), "image", "not fetched"),
    (lambda: as_json(image={"file_id": "file-1"}), "image.file_id", "file ids are not served"),
    (lambda: as_json(images=[{"file_id": "file-1"}]), "images[0].file_id", "file ids are not served"),
    (lambda: as_json(images=[{"image_url": "https://example.com/a.png"}]), "images[0].image_url", "not fetched"),
    (lambda: as_json(image="data:audio/wav;base64,AA=="), "image", "not an image"),
    (lambda: as_json(image=PNG_URL, response_format="url"), "response_format", "b64_json"),
    (lambda: uploaded([("image", ("a.png", PNG, "image/png"))], FLUX), "model",
     '"flux-tiny" does not edit images: it makes images from a prompt alone (POST /v1/images/generations)'),
    (lambda: as_json(WAN_I2V, image=PNG_URL), "model", '"wan-i2v-tiny" does not edit images: it makes no images'),
]


@pytest.mark.parametrize("translation, field, words", REFUSALS, ids=[f"{f}-{i}" for i, (_, f, _) in
                                                                     enumerate(REFUSALS)])
def test_what_cannot_be_edited_is_refused_naming_the_field(translation, field, words):
    with pytest.raises(InvalidRequest) as e:
        translation()
    assert e.value.field == field and words in str(e.value)
