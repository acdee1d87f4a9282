"""Images for the tests of request images: real image files made with Pillow, a PNG
that declares a size it does not hold, and a local HTTP server that serves them
(with redirects, errors, slow and oversized answers) as an image host would."""

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def noise(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Seeded RGB noise, height x width x 3: no two seeds draw the same image."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encode(pixels: np.ndarray, fmt: str = "PNG", **options: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height and whose data is a few bytes: what a
    decompression bomb looks like before its pixels are decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@dataclass
class Route:
    body: bytes = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    """Wait this long before answering (a slow host)."""
    declare_length: bool = True
    """Send Content-Length; False streams the body without one (the cap then counts bytes)."""


class ImageServer:
    """A threaded HTTP server on 127.0.0.1; `routes` maps a path to its answer."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: list[str] = []
        """Every path asked for, in order: a refused URL must never reach the server."""
        self.max_in_flight = 0
        """The most requests answered at once (inside a route's delay): concurrency, not timing."""
        routes, hits = self.routes, self.hits
        server = self
        lock = threading.Lock()
        in_flight = [0]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hits.append(self.path)
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    self.send_error(404)
                    return
                with lock:
                    in_flight[0] += 1
                    server.max_in_flight = max(server.max_in_flight, in_flight[0])
                try:
                    time.sleep(route.delay_s)
                finally:
                    with lock:
                        in_flight[0] -= 1
                try:
                    self.send_response(route.status)
                    for name, value in route.headers.items():
                        self.send_header(name, value)
                    if route.declare_length:
                        self.send_header("Content-Length", str(len(route.body)))
                    else:
                        self.send_header("Connection", "close")
                        self.close_connection = True
                    self.end_headers()
                    self.wfile.write(route.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout, a cap): what those tests want

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False  # a slow route's thread must not hold up the test's end
        self.port = self._server.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    @contextmanager
    def running(self) -> Iterator["ImageServer"]:
        thread = threading.Thread(target=self._server.serve_forever, name="image-server", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(5)
