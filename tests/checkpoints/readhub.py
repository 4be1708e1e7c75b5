"""A minimal read-only Hugging Face Hub for header-only tests (uniquely named helper).

Serves model repositories from local folders at ``HF_ENDPOINT``: the endpoints
huggingface_hub 2.x reads through (``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with
HTTP Range, ``GET /api/models/{repo}[/revision/{rev}]``), and records every byte range it
sent of each file, so a test can assert that no tensor data left the server.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class ReadHub:
    def __init__(self, repos: dict[str, Path]):
        self.repos = {k: Path(v) for k, v in repos.items()}
        self.sent: list[tuple[str, str, int, int]] = []  # (repo, file, first byte, last byte)
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "ReadHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def tensor_bytes_sent(self) -> int:
        """Bytes sent from beyond the safetensors header of any .safetensors file."""
        n = 0
        for repo, file, a, b in self.sent:
            if not file.endswith(".safetensors"):
                continue
            raw = (self.repos[repo] / file).read_bytes()[:8]
            data_start = 8 + struct.unpack("<Q", raw)[0]
            n += max(0, b + 1 - max(a, data_start))
        return n


def _handler(hub: ReadHub):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head=False):
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _not_found(self, head=False, code="EntryNotFound"):
            self._send(404, b'{"error": "not found"}',
                       {"X-Error-Code": code, "Content-Type": "application/json"}, head)

        def _route(self, head: bool):
            with hub._lock:
                hub.requests.append((self.command, self.path))
            path = self.path.split("?", 1)[0]
            m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
            if m:
                repo = m.group(1)
                if repo not in hub.repos:
                    return self._not_found(head, "RepoNotFound")
                files = [p.name for p in sorted(hub.repos[repo].iterdir()) if p.is_file()]
                body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": f} for f in files]}).encode()
                return self._send(200, body, {"Content-Type": "application/json"}, head)
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if not m:
                return self._not_found(head)
            repo, _rev, file = m.groups()
            if repo not in hub.repos:
                return self._not_found(head, "RepoNotFound")
            f = hub.repos[repo] / file
            if not f.is_file():
                return self._not_found(head)
            size = f.stat().st_size
            etag = hashlib.sha256(f"{repo}/{file}/{size}".encode()).hexdigest()
            base = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                    "Content-Type": "application/octet-stream"}
            rng = self.headers.get("Range") or self.headers.get("range")
            if head:
                self.send_response(200)
                for k, v in base.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                return
            a, b = 0, size - 1
            code = 200
            if rng:
                mm = re.match(r"bytes=(\d+)-(\d*)", rng)
                a = int(mm.group(1))
                b = min(int(mm.group(2)) if mm.group(2) else size - 1, size - 1)
                code = 206
                base["Content-Range"] = f"bytes {a}-{b}/{size}"
            with open(f, "rb") as fh:
                fh.seek(a)
                body = fh.read(b - a + 1)
            with hub._lock:
                hub.sent.append((repo, file, a, b))
            self._send(code, body, base)

        def do_HEAD(self):
            self._route(True)

        def do_GET(self):
            self._route(False)

    return H
