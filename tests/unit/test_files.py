"""kuberl.common.files.write_atomic: a reader polling the file while it is rewritten sees whole
contents only (`kuberl run` rewrites job.yaml while services and watchers read it)."""

from __future__ import annotations

import threading
from pathlib import Path

from kuberl.common.files import write_atomic


def test_a_reader_never_sees_a_half_written_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    versions = [f"{i}\n" + "x" * 200_000 + "\nend\n" for i in range(200)]
    write_atomic(path, versions[0])
    torn: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            text = path.read_text()
            if not text.endswith("end\n"):
                torn.append(len(text))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for text in versions[1:]:
            write_atomic(path, text)
    finally:
        done.set()
        reader.join()
    assert torn == []
    assert path.read_text() == versions[-1]
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]  # nothing left aside
