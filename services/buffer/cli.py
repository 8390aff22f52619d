"""`kuberl buffer ...` subcommands: see a job's buffer state without Redis tools.

`kuberl buffer stats --config job.yaml` asks the job's buffer service (`endpoints.buffer`, or
`--address`) for GetStats and prints a table: policy version, epoch and cursor, prompts leased,
groups pending, unacknowledged batches, and every counter (puts, duplicates, drops by reason...).
`--json` prints the same as one JSON object; `--redis` reads the job's Redis directly (when no
buffer replica is running).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

FIELDS = (
    "job",
    "policy_version",
    "epoch",
    "cursor",
    "prompts_total",
    "prompts_leased",
    "groups_pending",
    "batches_unacked",
    "batches_held",
    "groups_held",
    "exhausted",
)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    buffer = subparsers.add_parser("buffer", help="inspect the job's experience buffer")
    sub = buffer.add_subparsers(dest="buffer_command", required=True, metavar="<command>")
    stats = sub.add_parser("stats", help="print the job's buffer state and counters")
    stats.add_argument("--config", "-c", help="job YAML file (for endpoints.buffer)")
    stats.add_argument("--address", help="buffer host:port (default: endpoints.buffer)")
    stats.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    stats.add_argument(
        "--redis",
        action="store_true",
        help="read the job's Redis (redis.url) directly instead of asking the buffer service",
    )
    stats.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    stats.set_defaults(func=_cmd_stats)


def format_table(stats: dict[str, Any]) -> str:
    """The stats as a two-column table: the job fields first, then the counters, sorted."""
    rows = [(k, str(stats.get(k, ""))) for k in FIELDS]
    rows += [(k, str(v)) for k, v in sorted(stats.get("counters", {}).items())]
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    rule = f"+-{'-' * width}-+-{'-' * vwidth}-+"
    lines = [rule, f"| {'field'.ljust(width)} | {'value'.ljust(vwidth)} |", rule]
    lines += [f"| {k.ljust(width)} | {v.rjust(vwidth)} |" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)


async def _stats_from_redis(config: Any) -> Any:
    from kuberl.buffer.server import stats_response
    from kuberl.buffer.store import BufferStore

    store = BufferStore.from_config(config)
    try:
        return stats_response(await store.stats(), await store.exhausted("train"))
    finally:
        await store.close()


def _cmd_stats(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict
    from redis.exceptions import ResponseError

    from kuberl.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
    from kuberl.common.channels import sync_channel
    from kuberl.common.config import load_job_config
    from kuberl.common.errors import ServiceError

    config = load_job_config(args.config)
    if args.redis:
        try:
            resp = asyncio.run(_stats_from_redis(config))
        except ServiceError as exc:
            print(f"kuberl: {exc.message}", file=sys.stderr)
            return 1
        except ResponseError as exc:  # e.g. no streams: no buffer has served this job here
            print(
                f"kuberl: no buffer state for job {config.job.name!r} in this Redis ({exc})",
                file=sys.stderr,
            )
            return 1
    else:
        address = args.address or config.endpoints.buffer
        # A job file's TLS settings, as its services use them (else the environment's).
        tls = config.tls if args.config else None
        with sync_channel(address, tls=tls) as channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            try:
                resp = stub.GetStats(buffer_pb2.GetStatsRequest(), timeout=args.timeout)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    print(
                        f"kuberl: no buffer is listening at {address} "
                        f"({'--address' if args.address else 'endpoints.buffer'}). A live "
                        "`kuberl run` records its endpoints in its run folder: `kuberl buffer "
                        "stats --config runs/<run>/job.yaml`; or give --address HOST:PORT",
                        file=sys.stderr,
                    )
                    return 1
                print(
                    f"kuberl: buffer at {address}: {exc.code().name}: {exc.details()}",
                    file=sys.stderr,
                )
                return 1
    stats = MessageToDict(
        resp,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    # int64 fields come out of MessageToDict as strings; show them as numbers.
    for key, value in list(stats.items()):
        if isinstance(value, str) and value.lstrip("-").isdigit():
            stats[key] = int(value)
    stats["counters"] = {k: int(v) for k, v in stats.get("counters", {}).items()}
    print(json.dumps(stats, sort_keys=True) if args.json else format_table(stats))
    return 0
