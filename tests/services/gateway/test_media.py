"""The gateway's image fetching (media.py) and its 400s, with no tokenizer: data URLs, the
local path and host allow-lists, the byte and count limits, and a text-only model refusing
image parts before anything is encoded or submitted (the app over a stand-in service)."""

from __future__ import annotations

import asyncio
import base64

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.media import check_image_count, fetch_images
from shared.errors import InvalidRequest
from tests.services.gateway.fake_service import MODEL, FakeService

PNG = b"\x89PNG\r\n\x1a\n" + bytes(100)


def fetch(urls, **knobs):
    return asyncio.run(fetch_images(urls, GatewayConfig(**knobs)))


def code_of(urls, **knobs) -> str:
    with pytest.raises(InvalidRequest) as caught:
        fetch(urls, **knobs)
    assert caught.value.param == "messages"
    return caught.value.code


def test_data_urls_decode_and_their_limits_are_checked():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert fetch([url, url]) == [PNG, PNG]
    assert code_of([url], max_image_bytes=50) == "image_too_large"
    assert code_of(["data:image/png;base64,@@@"]) == "invalid_image"
    assert code_of(["data:text/plain;base64,aGk="]) == "unsupported_image_format"
    assert code_of(["ftp://host/a.png"]) == "invalid_image_url"


def test_local_files_only_under_the_allowed_path(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    url = f"file://{tmp_path}/a.png"
    assert code_of([url]) == "image_url_not_allowed"  # no --allowed-local-media-path
    assert fetch([url], allowed_local_media_path=str(tmp_path)) == [PNG]
    outside = f"file://{tmp_path}/../{tmp_path.name}-x/a.png"
    assert code_of([outside], allowed_local_media_path=str(tmp_path)) == \
        "image_url_not_allowed"
    assert code_of([url], allowed_local_media_path=str(tmp_path), max_image_bytes=10) == \
        "image_too_large"


def test_http_urls_only_from_allowed_hosts():
    assert code_of(["https://example.com/a.png"]) == "image_url_not_allowed"
    assert code_of(["https://example.com/a.png"], allowed_media_domains="other.org") == \
        "image_url_not_allowed"


def test_image_count_limits():
    check_image_count(2, True, {"image": 2})
    with pytest.raises(InvalidRequest, match="over the limit of 2"):
        check_image_count(3, True, {"image": 2})
    with pytest.raises(InvalidRequest, match="reads text only"):
        check_image_count(1, False, {"image": 2})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        GatewayConfig(limit_mm_per_prompt='{"video": 1}')
    assert GatewayConfig(limit_mm_per_prompt='{"image": 7}').mm_limits == {"image": 7}


def test_a_text_only_model_refuses_image_parts_before_submitting():
    service = FakeService()
    with TestClient(create_app(GatewayConfig(), service)) as client:
        reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "what is it"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "images_not_supported"
        assert service.submitted == []
        card = client.get("/v1/models").json()["data"][0]
        assert card["input_modalities"] == ["text"]
