"""The executor's /metrics: prometheus_client's default registry, every sample labelled
with the executor's replica (shared/metrics_labels.py).

prometheus_client's own `start_http_server` serves the registry as it is, with no way to
add a label to the metrics it does not declare (its process and GC collectors), so this
small server renders the exposition and labels it. It runs in a daemon thread: the
executor's loop is synchronous and must not wait on a scrape, nor a scrape on a step.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from shared.metrics_labels import with_replica


def serve_metrics(host: str, port: int, replica: str) -> ThreadingHTTPServer:
    """Serve the labelled exposition on `host:port` (any path, as start_http_server did)
    from a daemon thread; returns the server (its `server_address` has the bound port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = with_replica(generate_latest(REGISTRY), replica)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Scrapes every few seconds are not worth a log line each."""

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
