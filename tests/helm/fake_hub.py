"""A fake Hugging Face hub for tests/helm (the real one cannot be reached here): the four HTTP
endpoints huggingface_hub's snapshot_download calls for a public model repository (revision info,
file tree, HEAD and GET of each file), serving a few small files, and a log of what was asked."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    repo: str
    files: dict[str, bytes]
    url: str = ""
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, auth

    def downloads(self) -> list[str]:
        """Paths of the files whose content was fetched (GET of a `resolve` URL)."""
        return [p.rsplit("/", 1)[1] for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: bytes, headers: dict[str, str], code: int = 200) -> None:
            self.send_response(code)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _serve(self) -> None:
            path = self.path.split("?")[0]
            hub.requests.append((self.command, path, self.headers.get("Authorization", "")))
            api = f"/api/models/{hub.repo}"
            if path.startswith(f"{api}/tree/"):
                tree = [
                    {"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for n, d in hub.files.items()
                ]
                return self._reply(json.dumps(tree).encode(), {"Content-Type": "application/json"})
            if path.startswith(f"{api}/revision/"):
                info = {
                    "id": hub.repo,
                    "sha": COMMIT,
                    "siblings": [{"rfilename": n} for n in hub.files],
                }
                return self._reply(json.dumps(info).encode(), {"Content-Type": "application/json"})
            name = path.rsplit("/", 1)[1]
            if path == f"/{hub.repo}/resolve/{COMMIT}/{name}" and name in hub.files:
                data = hub.files[name]
                etag = f'"{hashlib.sha256(data).hexdigest()}"'
                return self._reply(data, {"X-Repo-Commit": COMMIT, "ETag": etag})
            return self._reply(b"not found", {}, 404)

        do_GET = do_HEAD = _serve

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def fake_hub(repo: str, files: dict[str, bytes]) -> Iterator[FakeHub]:
    hub = FakeHub(repo, files)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
