"""The one local fake Hugging Face Hub of the tests (push, inspect, plan): what
huggingface_hub 2.4 calls, read from its hf_api.py, file_download.py, _commit_api.py, lfs.py.

Reading (``inspect org/model``, ``plan org/model``):

* ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` -> X-Repo-Commit, ETag, Content-Length, the
  bytes honouring ``Range: bytes=a-b`` (206); 404 + X-Error-Code EntryNotFound/RepoNotFound
* ``GET /api/models/{repo}[/revision/{rev}]`` -> id, sha, siblings

Every byte range sent is recorded (``sent``), so a test can assert that no tensor data left.

Writing (``push``):

* ``POST /api/repos/create`` {name, organization, visibility, type} -> {url}; 409 if it exists
* ``POST /api/{type}s/{repo}/branch/{branch}`` -> 200 (409 if it exists)
* ``POST /api/validate-yaml`` {content, repoType} -> {errors, warnings}
* ``POST /api/{type}s/{repo}/preupload/{rev}`` {files} -> {files: [{path, uploadMode}]}
* ``POST /{repo}.git/info/lfs/objects/batch`` (LFS batch API; with HF_HUB_DISABLE_XET=1,
  Xet needs a CAS server) -> upload hrefs; ``PUT <href>`` the bytes (basic transfer)
* ``POST /api/{type}s/{repo}/commit/{rev}`` ndjson header/file/lfsFile -> {commitUrl}

``fail_upload=True`` makes every LFS PUT read part of the body and then drop the
connection without an answer: a network failure in the middle of an upload.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = "hf_fakehub_test_token"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """``files[repo_id]``: the readable files of a model repo ({name: bytes}; a folder given
    to the constructor is read from disk). ``repos[repo_id]``: repos created by a push
    (visibility, branches, commits)."""

    def __init__(self, files: dict[str, Path | dict[str, bytes]] | None = None,
                 lfs_suffixes=(".safetensors",), lfs_min_size=10_000_000):
        self.files: dict[str, dict[str, bytes | Path]] = {}
        for repo, src in (files or {}).items():
            self.files[repo] = dict(src) if isinstance(src, dict) else {
                p.name: p for p in sorted(Path(src).iterdir()) if p.is_file()}
        self.lfs_suffixes = tuple(lfs_suffixes)
        self.lfs_min_size = lfs_min_size
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}
        self.log: list[tuple[str, str]] = []  # (method, path) of every request
        self.reads: list[tuple[str, str, str | None]] = []  # (method, file, Range header)
        self.sent: list[tuple[str, str, int, int]] = []  # (repo, file, first byte, last byte)
        self.fail_upload = False
        self.put_attempts = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def commits(self, repo_id: str) -> list[dict]:
        return self.repos.get(repo_id, {}).get("commits", [])

    def data(self, repo: str, name: str) -> bytes | None:
        f = self.files.get(repo, {}).get(name)
        return f.read_bytes() if isinstance(f, Path) else f

    def tensor_bytes_sent(self) -> int:
        """Bytes sent from beyond the safetensors header of any .safetensors file."""
        n = 0
        for repo, file, a, b in self.sent:
            if file.endswith(".safetensors"):
                data_start = 8 + struct.unpack("<Q", self.data(repo, file)[:8])[0]
                n += max(0, b + 1 - max(a, data_start))
        return n


def point_at(hub: FakeHub, monkeypatch, tmp_path: Path, token: str = "") -> FakeHub:
    """Point this process's huggingface_hub at ``hub`` (endpoint, LFS instead of Xet, online,
    a private cache, ``token``, no backoff sleeps between retries)."""
    import time
    import types

    import huggingface_hub.utils._http as hf_http
    from huggingface_hub import constants
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    # huggingface_hub reads these at import: point the already imported module here
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    # http_backoff retries a dropped connection 5 times with 1..8 s sleeps
    fast = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    fast.sleep = lambda s: None
    monkeypatch.setattr(hf_http, "time", fast)
    return hub


def _handler(hub: FakeHub):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        # ---------------------------------------------------------------- io
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, code: int, obj=None, headers=None, raw: bytes | None = None) -> None:
            data = raw if raw is not None else json.dumps(obj if obj is not None else {}).encode()
            self.send_response(code)
            if raw is None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _not_found(self, code="EntryNotFound"):
            self._send(404, {"error": "not found"}, {"X-Error-Code": code})

        def _authorized(self) -> bool:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._send(401, {"error": "Invalid credentials"}, {"X-Error-Message": "Invalid credentials"})
                return False
            return True

        # ------------------------------------------------------ read routes
        def do_HEAD(self):  # noqa: N802
            self._read()

        def do_GET(self):  # noqa: N802
            self._read()

        def _read(self):
            path = self.path.split("?", 1)[0]
            hub.log.append((self.command, path))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                repo = m.group(1)
                if repo not in hub.files:
                    return self._not_found("RepoNotFound")
                return self._send(200, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                        "siblings": [{"rfilename": f} for f in sorted(hub.files[repo])]})
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._not_found()
            repo, _rev, name = m.groups()
            if repo not in hub.files:
                return self._not_found("RepoNotFound")
            data = hub.data(repo, name)
            if data is None:
                return self._not_found()
            rng = self.headers.get("Range")
            hub.reads.append((self.command, name, rng))
            first, last, code = 0, len(data) - 1, 200
            headers = {"X-Repo-Commit": COMMIT, "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if rng and self.command == "GET":
                a, b = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip()).groups()
                first, last, code = int(a), min(int(b) if b else len(data) - 1, len(data) - 1), 206
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            if self.command == "HEAD":
                return self._send(200, headers=headers, raw=data)  # Content-Length, no body
            with hub._lock:
                hub.sent.append((repo, name, first, last))
            self._send(code, headers=headers, raw=data[first:last + 1])

        # ----------------------------------------------------- write routes
        def do_POST(self):  # noqa: N802
            path = self.path.split("?")[0]
            hub.log.append(("POST", path))
            if path == "/api/validate-yaml":
                return self._validate_yaml()
            if not self._authorized():
                self._body()
                return
            if path == "/api/repos/create":
                return self._create_repo()
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/(.+)", path)
            if m:
                repo, op, rev = m.groups()
                if repo not in hub.repos:
                    self._body()
                    return self._send(404, {"error": "Repository not found"},
                                      {"X-Error-Code": "RepoNotFound"})
                return getattr(self, f"_{op}")(repo, rev)
            m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
            if m:
                return self._lfs_batch(m.group(1))
            self._body()
            self._send(404, {"error": f"no route {path}"})

        def do_PUT(self):  # noqa: N802
            path = self.path.split("?")[0]
            hub.log.append(("PUT", path))
            m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)
            if not m:
                self._body()
                return self._send(404, {"error": "no route"})
            hub.put_attempts += 1
            if hub.fail_upload:
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(min(n, 1024) if n else 1)
                # Drop the connection mid-upload, no response.
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self.close_connection = True
                return
            data = self._body()
            oid = m.group(1)
            if hashlib.sha256(data).hexdigest() != oid:
                return self._send(400, {"error": "sha256 mismatch"})
            with hub._lock:
                hub.lfs[oid] = data
            self._send(200, {})

        def _validate_yaml(self):
            body = json.loads(self._body() or b"{}")
            from huggingface_hub import ModelCard
            try:
                ModelCard(body.get("content", ""))
            except Exception as e:
                return self._send(400, {"errors": [{"message": str(e)}]})
            self._send(200, {"errors": [], "warnings": []})

        def _create_repo(self):
            body = json.loads(self._body() or b"{}")
            repo = f"{body.get('organization') or 'fake-user'}/{body['name']}"
            url = f"{hub.url}/{repo}"
            if repo in hub.repos:
                return self._send(409, {"error": "You already created this model repo", "url": url})
            hub.repos[repo] = {"visibility": body.get("visibility", "public"), "type": body.get("type"),
                               "branches": {"main"}, "commits": []}
            self._send(200, {"url": url, "name": repo})

        def _branch(self, repo, branch):
            self._body()
            if branch in hub.repos[repo]["branches"]:
                return self._send(409, {"error": "Reference already exists"})
            hub.repos[repo]["branches"].add(branch)
            self._send(200, {})

        def _preupload(self, repo, rev):
            body = json.loads(self._body())
            files = []
            for f in body["files"]:
                lfs = f["path"].endswith(hub.lfs_suffixes) or f["size"] >= hub.lfs_min_size
                files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                              "shouldIgnore": False, "oid": None})
            self._send(200, {"files": files, "commitOid": "0" * 40})

        def _lfs_batch(self, repo):
            body = json.loads(self._body())
            objs = []
            for o in body["objects"]:
                entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
                if o["oid"] not in hub.lfs:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}
                objs.append(entry)
            self._send(200, {"transfer": "basic", "objects": objs})

        def _commit(self, repo, rev):
            lines = [json.loads(ln) for ln in self._body().splitlines() if ln.strip()]
            rev = rev.replace("%2F", "/")
            if rev not in hub.repos[repo]["branches"]:
                return self._send(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
            header = lines[0]
            files = {}
            for ln in lines[1:]:
                v = ln["value"]
                if ln["key"] == "file":
                    data = base64.b64decode(v["content"])
                    files[v["path"]] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                        "lfs": False, "content": data}
                elif ln["key"] == "lfsFile":
                    if v["oid"] not in hub.lfs:
                        return self._send(400, {"error": f"LFS object {v['oid']} was not uploaded"})
                    if len(hub.lfs[v["oid"]]) != v.get("size"):
                        return self._send(400, {"error": "LFS size mismatch"})
                    files[v["path"]] = {"size": v["size"], "sha256": v["oid"], "lfs": True}
                else:
                    return self._send(400, {"error": f"unexpected operation {ln['key']}"})
            oid = hashlib.sha1(json.dumps([repo, rev, len(hub.commits(repo)), sorted(files)]).encode()).hexdigest()
            hub.repos[repo]["commits"].append({"branch": rev, "header": header["value"], "files": files,
                                               "oid": oid})
            # what was pushed reads back like any other repo
            hub.files.setdefault(repo, {}).update(
                {p: f.get("content", hub.lfs.get(f["sha256"])) for p, f in files.items()})
            self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                             "success": True})

    return H
