"""The images a chat request's image parts name, fetched before anything is encoded or
scheduled (docs/vision.md): ``data:`` URLs decoded, ``file://`` URLs read from under
``--allowed-local-media-path`` only, ``http(s)://`` URLs fetched from the hosts of
``--allowed-media-domains`` only (no redirects, a deadline, the byte limit enforced while
reading). Each limit refused is a 400 naming it; decoding and the pixel limit are the
tokenizer tier's (services/tokenizer/images.py)."""

from __future__ import annotations

import asyncio
import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from shared.errors import InvalidRequest

PARAM = "messages"


def check_image_count(num_images: int, accepts_images: bool, limits: dict[str, int]) -> None:
    """A 400 for images sent to a text-only model, or more than --limit-mm-per-prompt."""
    if num_images and not accepts_images:
        raise InvalidRequest("this model reads text only: it takes no image parts",
                             param=PARAM, code="images_not_supported")
    limit = limits.get("image", 0)
    if num_images > limit:
        raise InvalidRequest(f"the prompt has {num_images} images, over the limit of {limit} "
                             f"(--limit-mm-per-prompt)", param=PARAM, code="too_many_images")


async def fetch_images(urls: list[str], config) -> list[bytes]:
    """Each URL's bytes, in order; ``config``: the gateway's (its MediaInput knobs)."""
    return list(await asyncio.gather(*(fetch_image(url, index, config)
                                       for index, url in enumerate(urls))))


async def fetch_image(url: str, index: int, config) -> bytes:
    where = f"image {index + 1}"
    scheme = urlsplit(url).scheme.lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, where, config.max_image_bytes)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, where, config)
    if scheme in ("http", "https"):
        return await _http(url, where, config)
    raise InvalidRequest(f"{where}: unsupported URL scheme {scheme or url[:16]!r} (data:, "
                         f"http(s):// from --allowed-media-domains, file:// under "
                         f"--allowed-local-media-path)", param=PARAM, code="invalid_image_url")


def _too_large(where: str, size: int | str, limit: int) -> InvalidRequest:
    return InvalidRequest(f"{where} is {size} bytes, over the limit of {limit} bytes "
                          f"(--max-image-bytes)", param=PARAM, code="image_too_large")


def _data_url(url: str, where: str, max_bytes: int) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequest(f"{where}: a data URL must be data:image/<format>;base64,...",
                             param=PARAM, code="invalid_image_url")
    mime = header.removesuffix(";base64").split(";")[0].lower()
    if mime and not mime.startswith("image/"):
        raise InvalidRequest(f"{where}: unsupported image format {mime!r}", param=PARAM,
                             code="unsupported_image_format")
    if len(payload) * 3 // 4 > max_bytes + 3:  # (before decoding it)
        raise _too_large(where, f"about {len(payload) * 3 // 4}", max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{where}: the data URL is not valid base64", param=PARAM,
                             code="invalid_image") from exc
    if len(data) > max_bytes:
        raise _too_large(where, len(data), max_bytes)
    return data


def _local_file(url: str, where: str, config) -> bytes:
    root = config.allowed_local_media_path
    if not root:
        raise InvalidRequest(f"{where}: file:// URLs are not allowed (no "
                             f"--allowed-local-media-path)", param=PARAM,
                             code="image_url_not_allowed")
    path = Path(unquote(urlsplit(url).path)).resolve()
    if not path.is_relative_to(Path(root).resolve()):
        raise InvalidRequest(f"{where}: {path} is outside --allowed-local-media-path",
                             param=PARAM, code="image_url_not_allowed")
    if not path.is_file():
        raise InvalidRequest(f"{where}: no such file {path}", param=PARAM,
                             code="invalid_image_url")
    size = path.stat().st_size
    if size > config.max_image_bytes:
        raise _too_large(where, size, config.max_image_bytes)
    return path.read_bytes()


async def _http(url: str, where: str, config) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in config.media_domains:
        raise InvalidRequest(f"{where}: host {host!r} is not in --allowed-media-domains",
                             param=PARAM, code="image_url_not_allowed")
    limit = config.max_image_bytes
    try:
        async with httpx.AsyncClient(timeout=config.media_fetch_timeout_s,
                                     follow_redirects=False) as client:
            return await asyncio.wait_for(_read_capped(client, url, where, limit),
                                          config.media_fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        raise InvalidRequest(f"{where}: fetching {url} took over "
                             f"{config.media_fetch_timeout_s} s (--media-fetch-timeout-s)",
                             param=PARAM, code="image_fetch_failed") from exc
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"{where}: fetching {url} failed: {exc}", param=PARAM,
                             code="image_fetch_failed") from exc


async def _read_capped(client: httpx.AsyncClient, url: str, where: str, limit: int) -> bytes:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise InvalidRequest(f"{where}: fetching {url} gave HTTP {response.status_code}",
                                 param=PARAM, code="image_fetch_failed")
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise _too_large(where, f"over {limit}", limit)
            chunks.append(chunk)
        return b"".join(chunks)
