"""The tokenizer tier's images (images.py): decoding and its 400s, and a vision-language
model's prompt with images against transformers' own processor (token ids, pixels, each
image's placeholders), a text-only model refusing them."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from services.tokenizer.encoding import TextCodec
from services.tokenizer.images import check_pixel_bytes, compact_pixels, decode_image
from services.worker.image_inputs import image_pixels
from shared.errors import InvalidRequest
from shared.sections.media import MAX_PIXEL_BYTES
from shared.messages import ChatMessage, ContentPart, EncodeRequest
from tests.services.worker.idefics3_checkpoint import shared_idefics3_checkpoint


def encoded(image: Image.Image, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def test_decoding_refuses_corrupt_foreign_and_oversized_images():
    red = Image.new("RGB", (40, 30), "red")
    assert decode_image(encoded(red), 10_000).size == (40, 30)
    for data, limit, code in ((b"\x89PNG\r\n\x1a\nbroken", 10_000, "invalid_image"),
                              (encoded(red, "TIFF"), 10_000, "unsupported_image_format"),
                              (encoded(red), 1_000, "image_too_large")):
        with pytest.raises(InvalidRequest) as caught:
            decode_image(data, limit)
        assert caught.value.code == code and caught.value.param == "messages"


@pytest.fixture(scope="module")
def vlm_codec(tmp_path_factory):
    return TextCodec(shared_idefics3_checkpoint(tmp_path_factory))


def test_a_chat_with_images_is_expanded_as_transformers_does(vlm_codec):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(vlm_codec.model_dir))
    rng = np.random.default_rng(0)
    a = Image.fromarray(rng.integers(0, 255, (200, 300, 3), dtype=np.uint8))
    b = Image.new("RGB", (100, 90), "blue")
    request = EncodeRequest(messages=[ChatMessage(role="user", content="AB", parts=[
        ContentPart(type="text", text="A"), ContentPart(type="image"),
        ContentPart(type="text", text="B"), ContentPart(type="image")])],
        images=[encoded(a), encoded(b)])
    token_ids, images = vlm_codec.encode_with_images(request)
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"},
        {"type": "image"}]}], add_generation_prompt=True)
    theirs = processor(text=text, images=[[a, b]], add_special_tokens=False, return_tensors="np")
    assert token_ids == theirs["input_ids"][0].tolist()
    # each resized to a 1,024-pixel longest edge: 2 x 2 tiles and the global view
    assert [image.pixel_shape[0] for image in images] == [5, 5]
    pixels = torch.cat([image_pixels(image) for image in images]).numpy()
    assert pixels.tobytes() == theirs["pixel_values"][0].astype(np.float32).tobytes()
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    for image in images:  # each span holds its tiles' 64 image tokens, from its first one
        span = token_ids[image.offset:image.offset + image.length]
        assert span[0] == span[-1] == image_token
        assert span.count(image_token) == 64 * image.pixel_shape[0]
    assert images[0].hash != images[1].hash
    assert vlm_codec.info("m").accepts_images


def test_a_text_only_model_refuses_images(tmp_path):
    from shared.models import resolve_model

    codec = TextCodec(resolve_model("smollm2").path)
    assert not codec.info("m").accepts_images
    with pytest.raises(InvalidRequest) as caught:
        codec.encode_with_images(EncodeRequest(messages=[ChatMessage(role="user", content="x")],
                                               images=[b"x"]))
    assert caught.value.code == "images_not_supported"


def test_pixels_without_an_exact_table_travel_as_float32():
    class Processor:
        image_mean, image_std, rescale_factor = [0.5] * 3, [0.5] * 3, 1 / 255

    exact = ((np.arange(256, dtype=np.float32)[None, None, None, :].repeat(3, 1) / 255
              - 0.5) / 0.5)  # [1, 3, 1, 256]: every 8-bit value
    codes, table = compact_pixels(exact, Processor())
    assert np.array_equal(table[np.arange(3)[:, None], codes[0, :, 0]], exact[0, :, 0])
    # two values of one code (a resize in float would make them): no exact table
    resampled = np.concatenate([exact, exact + np.float32(1e-4)], axis=-1)
    assert compact_pixels(resampled, Processor()) is None


def test_pixels_over_what_a_message_carries_are_a_400_naming_the_cut():
    half = SimpleNamespace(pixels=bytes(MAX_PIXEL_BYTES // 2 + 1))
    check_pixel_bytes([half], "1 tile")
    with pytest.raises(InvalidRequest, match=r"\(3 patches\), over the") as refused:
        check_pixel_bytes([half, half], "3 patches")
    assert refused.value.code == "image_too_large"
