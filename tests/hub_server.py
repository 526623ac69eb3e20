"""A Hugging Face Hub stand-in on 127.0.0.1: one folder served as one model repository at one commit, in the
Hub's HTTP layout, for the real Hub client (`snapshot_download` with HF_ENDPOINT pointing here).

What the client calls (huggingface_hub's hf_api.py and file_download.py):
- GET  /api/models/{repo}/revision/{revision}       the repository's info: id, sha (the commit), siblings;
- GET  /api/models/{repo}/tree/{commit}?recursive=  its files: type, path, size, oid (no Link: one page);
- HEAD /{repo}/resolve/{commit}/{file}              X-Repo-Commit, ETag, Content-Length (no redirect);
- GET  /{repo}/resolve/{commit}/{file}              the bytes.
Every request must bear `Authorization: Bearer TOKEN`: else 401, as the Hub answers a private repository.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

# The commit the repository is at (any 40 hex digits: the client takes it for a commit hash).
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(self, repo_id: str, folder: Path, token: str, revision: str = "main"):
        self.repo_id, self.folder, self.token, self.revision = repo_id, folder, token, revision
        self.files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        self.requests: list[tuple[str, str]] = []   # (method, path) of every request, answered or not
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=30)

    def knows(self, revision: str) -> bool:
        return revision in (self.revision, COMMIT)


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:   # quiet: the test asserts on what was asked instead
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            if self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self._json(401, {"error": "Invalid credentials in Authorization header"}, body)
            info, tree = f"/api/models/{hub.repo_id}/revision/", f"/api/models/{hub.repo_id}/tree/"
            resolve = f"/{hub.repo_id}/resolve/"
            if path.startswith(info):
                if not hub.knows(path[len(info):]):
                    return self._json(404, {"error": "Invalid rev id"}, body, {"X-Error-Code": "RevisionNotFound"})
                return self._json(200, {"id": hub.repo_id, "sha": COMMIT,
                                        "siblings": [{"rfilename": f} for f in hub.files]}, body)
            if path.startswith(tree):
                return self._json(200, [{"type": "file", "path": f, "size": (hub.folder / f).stat().st_size,
                                         "oid": _digest(hub.folder / f, "sha1")} for f in hub.files], body)
            if path.startswith(resolve):
                revision, _, name = path[len(resolve):].partition("/")
                if not hub.knows(revision) or name not in hub.files:
                    return self._json(404, {"error": "Entry not found"}, body, {"X-Error-Code": "EntryNotFound"})
                data = (hub.folder / name).read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return None
            return self._json(404, {"error": "Repository not found"}, body, {"X-Error-Code": "RepoNotFound"})

        def _json(self, status: int, doc, body: bool, headers: dict | None = None) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


def _digest(path: Path, algorithm: str) -> str:
    return hashlib.new(algorithm, path.read_bytes()).hexdigest()
