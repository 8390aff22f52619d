"""SGLang's native weight-update requests for an `UpdateInstruction` (rollout's SGLang engine).

An SGLang server receives a broadcast itself: the rollout replica posts
`/init_weights_update_group`, then one `/update_weights_from_distributed` per bucket (with
`load_format="flattened_bucket"`, the layout of `kuberl.common.weights.manifest`) while the
sender broadcasts that bucket, then `/destroy_weights_update_group`. SGLang loads each bucket
as it arrives, so the adapter pauses generation first (`/pause_generation`) and continues after
the last bucket: the engine never serves a mix of two versions. These functions build the
JSON bodies; the HTTP calls belong to the rollout service's engine adapter. Field names are those
of SGLang's `InitWeightsUpdateGroupReqInput` / `UpdateWeightsFromDistributedReqInput`.
"""

from __future__ import annotations

from typing import Any

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.manifest import Manifest


def init_group_request(instruction: pb.UpdateInstruction) -> dict[str, Any]:
    """Body of POST /init_weights_update_group: the engine's TP ranks start at `rank`."""
    g = instruction.group
    return {
        "master_address": g.master_address,
        "master_port": g.master_port,
        "rank_offset": instruction.rank,
        "world_size": g.world_size,
        "group_name": g.group_name,
        "backend": g.backend,
    }


def update_requests(
    instruction: pb.UpdateInstruction, *, flush_cache: bool = True
) -> list[dict[str, Any]]:
    """Bodies of POST /update_weights_from_distributed, one per bucket, in broadcast order.

    Each call blocks inside SGLang until its bucket's broadcast completes, so post them one at a
    time; only the last flushes the cache (the engine then serves the new version whole)."""
    manifest = Manifest.from_proto(instruction.manifest)
    bodies = []
    for b in range(manifest.num_buckets):
        entries = manifest.bucket_entries(b)
        bodies.append(
            {
                "names": [e.name for e in entries],
                "dtypes": [e.dtype for e in entries],
                "shapes": [list(e.shape) for e in entries],
                "group_name": instruction.group.group_name,
                "load_format": "flattened_bucket",
                "flush_cache": flush_cache and b == manifest.num_buckets - 1,
                "weight_version": str(instruction.version),
            }
        )
    return bodies


def destroy_group_request(instruction: pb.UpdateInstruction) -> dict[str, Any]:
    """Body of POST /destroy_weights_update_group (groups are formed per version)."""
    return {"group_name": instruction.group.group_name}
