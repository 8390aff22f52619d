"""Subcommands for deployments: `kuberl chart schema` and `kuberl health`.

`kuberl chart schema` regenerates the job section of the Helm chart's values.schema.json from the
job models (`--check` only compares, for CI). `kuberl health ADDRESS...` asks each address for its
grpc.health.v1 status until all say SERVING or the timeout passes; the chart's `helm test` pod runs
it against every service. The root CLI (services/cli.py) discovers this module.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _cmd_chart_schema(args: argparse.Namespace) -> int:
    from kuberl.common.schema import regenerate

    path = Path(args.path)
    try:
        on_disk, expected = regenerate(path)
    except (OSError, ValueError) as exc:  # missing or not a schema: a message, not a traceback
        print(f"kuberl: {exc}", file=sys.stderr)
        return 2
    if on_disk == expected:
        print(f"{path}: up to date")
        return 0
    if args.check:
        print(
            f"{path}: the job section is out of date with kuberl.common.config; "
            "run `kuberl chart schema` and commit the result",
            file=sys.stderr,
        )
        return 1
    path.write_text(expected)
    print(f"{path}: regenerated")
    return 0


def check_health(addresses: list[str], timeout: float, service: str = "") -> dict[str, str]:
    """Poll every address until all are SERVING or `timeout` passes; the last status of each."""
    from kuberl.common.channels import health_status, sync_channel

    deadline = time.monotonic() + timeout
    status = dict.fromkeys(addresses, "UNAVAILABLE")
    channels = {address: sync_channel(address) for address in addresses}
    try:
        while True:
            for address, channel in channels.items():
                if status[address] != "SERVING":
                    status[address] = health_status(channel, service)
            if all(s == "SERVING" for s in status.values()) or time.monotonic() >= deadline:
                return status
            time.sleep(0.5)
    finally:
        for channel in channels.values():
            channel.close()


def _cmd_health(args: argparse.Namespace) -> int:
    status = check_health(args.addresses, args.timeout, args.service)
    for address, state in status.items():
        print(f"{address} {state}")
    return 0 if all(s == "SERVING" for s in status.values()) else 1


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    chart = subparsers.add_parser("chart", help="maintain the Helm chart (helm/kuberl)")
    chart_sub = chart.add_subparsers(dest="chart_command", required=True, metavar="<action>")
    schema = chart_sub.add_parser(
        "schema", help="regenerate the job section of values.schema.json from the job models"
    )
    schema.add_argument(
        "--path",
        default="helm/kuberl/values.schema.json",
        help="the chart's schema file (default: %(default)s)",
    )
    schema.add_argument(
        "--check", action="store_true", help="only compare; exit 1 when the file is out of date"
    )
    schema.set_defaults(func=_cmd_chart_schema)

    health = subparsers.add_parser(
        "health", help="wait until gRPC services report SERVING (grpc.health.v1)"
    )
    health.add_argument("addresses", nargs="+", metavar="HOST:PORT")
    health.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait (default: %(default)s)"
    )
    health.add_argument(
        "--service", default="", help="service name to ask about ('' = the whole server)"
    )
    health.set_defaults(func=_cmd_health)
