"""Images for `flotilla bench serve` (docs/vision.md): each request of a dataset given
``--images-per-request`` seeded random JPEGs of ``--image-size``, sent as chat image parts
(data URLs) before its text. Each image is its own noise, so no encoder cache or prefix
cache serves one request's images to another (vLLM's random multimodal dataset does the
same); the server's preprocessing, encoder and placeholder tokens are what is measured."""

from __future__ import annotations

import base64
import dataclasses
import io

import numpy as np

from cli.bench.datasets import BenchRequest, DatasetError


def parse_size(text: str) -> tuple[int, int]:
    """'640x480' -> (640, 480)."""
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or not int(width) or not int(height):
        raise DatasetError(f"--image-size must be WIDTHxHEIGHT, e.g. 640x640, not {text!r}")
    return int(width), int(height)


def image_data_url(width: int, height: int, rng: np.random.Generator) -> str:
    """A noise JPEG (quality 90) as a data URL."""
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def with_images(requests: list[BenchRequest], count: int, size: str, seed: int
                ) -> list[BenchRequest]:
    """Each request as one user message: ``count`` images, then its prompt text. Its
    ``prompt_ids`` stay the text's (the images' placeholder tokens are the server's)."""
    if count < 0:
        raise DatasetError("--images-per-request must be 0 or more")
    if count == 0:
        return requests
    width, height = parse_size(size)
    rng = np.random.default_rng(seed)
    out = []
    for request in requests:
        if request.messages is not None:
            raise DatasetError("--images-per-request takes a dataset of single prompts "
                               "(random, shared-prefix, sharegpt), not multi-turn")
        parts = [{"type": "image_url", "image_url": {"url": image_data_url(width, height, rng)}}
                 for _ in range(count)]
        parts.append({"type": "text", "text": request.prompt})
        out.append(dataclasses.replace(request, messages=({"role": "user", "content": parts},)))
    return out
