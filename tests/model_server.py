"""A local HTTP server (127.0.0.1, a thread) standing in for the published-model host: serves bytes by path,
records every request, and can cut a file's body short (a truncated download)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ModelServer:
    """files: URL path -> bytes. truncate: paths whose body stops halfway (Content-Length announces all of it).
    status: URL path (its query string left out) -> the HTTP status every request gets (an error); get_status: the
    same for GET only (HEAD answers as for a file: an expired presigned URL, a server failing mid-read)."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.truncate: set[str] = set()
        self.status: dict[str, int] = {}
        self.get_status: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, body: bool):
                server.requests.append((self.command, self.path))
                path = self.path.split("?", 1)[0]
                failing = server.status.get(path) or (server.get_status.get(path) if body else None)
                if failing:
                    self.send_error(failing)
                    return
                data = server.files.get(self.path, server.files.get(path))
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if body:
                    self.wfile.write(data[: len(data) // 2] if self.path in server.truncate else data)
                    if self.path in server.truncate:
                        self.close_connection = True

            def do_GET(self):
                self._serve(True)

            def do_HEAD(self):
                self._serve(False)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def gets(self, suffix: str = "") -> int:
        """GET requests so far for paths ending in `suffix`."""
        return sum(1 for m, p in self.requests if m == "GET" and p.endswith(suffix))

    def __enter__(self) -> "ModelServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
