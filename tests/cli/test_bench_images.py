"""`flotilla bench serve --images-per-request N --image-size WxH` (cli/bench/images.py):
each prompt becomes one chat message of N distinct seeded JPEGs of that size before its
text, sent to the chat endpoint."""

from __future__ import annotations

import argparse
import base64
import io

import pytest
from PIL import Image

from cli.bench import options
from cli.bench.datasets import BenchRequest, DatasetError
from cli.bench.images import parse_size, with_images


def decoded(url: str) -> Image.Image:
    header, _, payload = url.partition(",")
    assert header == "data:image/jpeg;base64"
    return Image.open(io.BytesIO(base64.b64decode(payload)))


def test_prompts_carry_distinct_images_of_the_size_before_their_text():
    requests = [BenchRequest(f"prompt {i}", [i], 8) for i in range(3)]
    out = with_images(requests, 2, "64x48", seed=1)
    urls = []
    for request, original in zip(out, requests):
        (message,) = request.messages
        *images, text = message["content"]
        assert text == {"type": "text", "text": original.prompt}
        assert request.prompt_ids == original.prompt_ids
        for part in images:
            assert decoded(part["image_url"]["url"]).size == (64, 48)
            urls.append(part["image_url"]["url"])
    assert len(set(urls)) == 6  # no image repeats: no cache serves one
    assert with_images(requests, 2, "64x48", seed=1) == out  # seeded
    assert with_images(requests, 0, "64x48", seed=1) is requests


def test_bad_image_flags_are_refused():
    for size in ("64", "0x5", "ax4"):
        with pytest.raises(DatasetError, match="image-size"):
            parse_size(size)
    with pytest.raises(DatasetError, match="images-per-request"):
        with_images([BenchRequest("p", [1], 8)], -1, "8x8", seed=0)


def test_images_send_to_the_chat_endpoint():
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", default=None)
    options.add_dataset_flags(parser, num_prompts_default=4)
    assert options.endpoint(parser.parse_args(["--images-per-request", "1"])) == "chat"
    assert options.endpoint(parser.parse_args([])) == "completions"
    with pytest.raises(DatasetError, match="endpoint chat"):
        options.endpoint(parser.parse_args(["--images-per-request", "1",
                                            "--endpoint", "completions"]))
