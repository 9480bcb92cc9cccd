"""A streaming completion read in a background thread, for tests that kill things while
streams are in flight."""

from __future__ import annotations

import json
import threading

import httpx


class StreamReader(threading.Thread):
    """One streaming completion: its text pieces, error events, and whether [DONE] came."""

    def __init__(self, base_url: str, request: dict) -> None:
        super().__init__(daemon=True)
        self.base_url, self.request = base_url, request
        self.parts: list[str] = []
        self.errors: list[dict] = []
        self.done = False
        self.exception: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base_url + "/v1/completions", json=self.request,
                              timeout=180) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        payload = json.loads(line[6:])
                        if "error" in payload:
                            self.errors.append(payload["error"])
                        elif payload["choices"]:
                            self.parts.append(payload["choices"][0]["text"])
        except Exception as exc:  # noqa: BLE001 - the test reports it
            self.exception = exc

    @property
    def text(self) -> str:
        return "".join(self.parts)
