"""Download a Hugging Face model once into the models volume: the chart's model-download Job runs
this with `python3 -c`. It skips the download when the folder's marker names this id and revision,
and writes the marker only after every file is in place, so the pods waiting for it (their
wait-for-model init step) never read a partial download."""

import os
import pathlib
import sys

from huggingface_hub import snapshot_download

repo = os.environ["KUBERL_MODEL_ID"]
revision = os.environ["KUBERL_MODEL_REVISION"]
target = pathlib.Path(os.environ["KUBERL_MODEL_DIR"])
marker = target / ".kuberl-download-complete"
wanted = f"{repo}@{revision}"

if marker.is_file() and marker.read_text().strip() == wanted:
    print(f"model-download: {wanted} is already in {target}", flush=True)
    sys.exit(0)
target.mkdir(parents=True, exist_ok=True)
print(f"model-download: fetching {wanted} into {target}", flush=True)
snapshot_download(
    repo_id=repo, revision=revision, local_dir=target, token=os.environ.get("HF_TOKEN") or None
)
partial = marker.with_name(marker.name + ".tmp")
partial.write_text(wanted + "\n")
partial.replace(marker)
print(f"model-download: {wanted} is complete in {target}", flush=True)
