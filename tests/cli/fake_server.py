"""A scripted OpenAI-style HTTP server on a random port, for ``flotilla bench`` end to end."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServer:
    """Answers every POST with ``script(call_number, body)``: a list of SSE payloads, or
    None to stall (send the headers and one chunk, then nothing until the server is
    closed). GET /metrics answers ``metrics()`` when given (404 otherwise). ``bodies``
    keeps every POST body in arrival order."""

    def __init__(self, script: Callable[[int, dict], list[dict] | None],
                 metrics: Callable[[], str] | None = None) -> None:
        self.script = script
        self.calls = 0
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server API)
                if self.path != "/metrics" or metrics is None:
                    self.send_error(404)
                    return
                text = metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.calls += 1
                    outer.bodies.append(body)
                    payloads = outer.script(outer.calls, body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if payloads is None:
                    self.write({"choices": [{"index": 0, "text": "", "finish_reason": None}]})
                    outer.closing.wait(30)
                    return
                for payload in payloads:
                    self.write(payload)
                self.wfile.write(b"data: [DONE]\n\n")

            def write(self, payload: dict) -> None:
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        self.http.shutdown()
        self.http.server_close()
