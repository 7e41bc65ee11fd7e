"""moto's S3 server on 127.0.0.1 behind a WSGI middleware that answers a share of the requests with a
transient error (503 SlowDown or 500 InternalError, S3's own error bodies) before they reach moto, and
counts what it injected. Deterministic for a given seed and request order."""
import random
import socket
import threading
from collections import Counter

ERRORS = {"SlowDown": "503 Slow Down", "InternalError": "500 Internal Server Error"}


class FaultInjector:
    def __init__(self, app, rate: float, seed: int = 0):
        self.app, self.rate, self.rng, self.lock = app, rate, random.Random(seed), threading.Lock()
        self.enabled, self.requests, self.injected = False, 0, Counter()

    def __call__(self, environ, start_response):
        with self.lock:
            self.requests += 1
            code = (self.rng.choice(sorted(ERRORS)) if self.enabled and self.rng.random() < self.rate else None)
            if code:
                self.injected[(code, environ["REQUEST_METHOD"])] += 1
        if code is None:
            return self.app(environ, start_response)
        n = int(environ.get("CONTENT_LENGTH") or 0)    # read the body the client sent, as a server does
        if n > 0:
            environ["wsgi.input"].read(n)
        elif environ.get("wsgi.input_terminated"):
            environ["wsgi.input"].read()
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected '
                f'transient error</Message><RequestId>fault-{self.requests}</RequestId></Error>').encode()
        start_response(ERRORS[code], [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]


class FlakyS3:
    """start() / stop(); `endpoint`; `faults.enabled`, `faults.injected` (Counter of (code, method))."""

    def __init__(self, rate: float = 0.25, seed: int = 0):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        self.faults = FaultInjector(DomainDispatcherApplication(create_backend_app), rate, seed)

    def start(self):
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from werkzeug.serving import make_server
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = make_server("127.0.0.1", port, self.faults, threaded=True, request_handler=MotoRequestHandler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def stop(self):
        self.server.shutdown()
        self.thread.join()
