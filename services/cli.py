"""The `kuberl` command line: one console script with subcommands.

`kuberl serve <service>` is the entrypoint every container (and every local-mode process) runs.
Services contribute their own subcommands (`kuberl buffer stats`, `kuberl reward score`, ...) by
shipping a `cli.py` module with `add_commands(subparsers)`; those modules import heavy libraries
only inside their handlers so `kuberl --help` stays fast. This module reaches a service only
through its `server` and `cli` modules, imported by name when needed (the rule:
tests/unit/test_boundaries.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Callable, Sequence

from kuberl import __version__

SERVICES = ("buffer", "reward", "rollout", "trainer", "weight_sync")
# Packages that may contribute subcommands through a `cli` module.
COMMAND_PROVIDERS = ("common", "buffer", "reward", "rollout", "trainer", "weight_sync", "local")


def _service_name(value: str) -> str:
    name = value.replace("-", "_")
    if name not in SERVICES:
        raise argparse.ArgumentTypeError(
            f"unknown service {value!r}; expected one of {', '.join(SERVICES)}"
        )
    return name


def _cmd_serve(args: argparse.Namespace) -> int:
    from kuberl.common.config import load_job_config
    from kuberl.common.logs import setup_logging
    from kuberl.common.preflight import with_local_models
    from kuberl.common.server import serve

    config = load_job_config(args.config)
    config.check_files(args.service)
    config = with_local_models(config, args.service)
    setup_logging(args.service)
    try:
        module = importlib.import_module(f"kuberl.{args.service}.server")
    except ModuleNotFoundError as exc:
        if exc.name != f"kuberl.{args.service}.server":
            raise
        print(f"kuberl: service {args.service!r} has no server module yet", file=sys.stderr)
        return 2
    service = module.create_service(config)
    section = getattr(config, args.service)
    asyncio.run(
        serve(
            service, section.server, port_file=args.port_file, tls=config.tls, job=config.job.name
        )
    )
    leave = getattr(module, "leave", None)  # a service whose process must skip finalization
    if leave is not None:
        leave(0)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from kuberl.common.config import JobConfig, dump_job_config, load_job_config

    if args.action == "schema":
        print(json.dumps(JobConfig.model_json_schema(), indent=2))
        return 0
    config = load_job_config(args.config, overrides=args.overrides)
    if args.action == "show":
        print(dump_job_config(config), end="")
        return 0
    if args.files:
        from pathlib import Path

        from kuberl.common.preflight import check_job

        check_job(config, Path.cwd())
    print(
        f"{args.config or '<defaults>'}: ok"
        + (" (files, models, datasets, plugins)" if args.files else "")
    )
    return 0


def _cmd_version(_: argparse.Namespace) -> int:
    print(f"kuberl {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kuberl",
        description="RL post-training for LLMs as Kubernetes-native microservices.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")

    serve = sub.add_parser("serve", help="run one service (the container entrypoint)")
    serve.add_argument("service", type=_service_name, help=" | ".join(SERVICES))
    serve.add_argument("--config", "-c", help="job YAML file (defaults when omitted)")
    serve.add_argument(
        "--port-file", help="write the bound ports as JSON here once listening (port 0 in config)"
    )
    serve.set_defaults(func=_cmd_serve)

    config = sub.add_parser("config", help="validate, show or describe a job file")
    config.add_argument("action", choices=("check", "show", "schema"))
    config.add_argument("config", nargs="?", help="job YAML file")
    config.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides of the job file's fields (trainer.optimizer.lr=1e-6)",
    )
    config.add_argument(
        "--files",
        action="store_true",
        help="check: also every file, model, dataset and plugin the job names (fetching hub "
        "ids into the Hugging Face cache), as `kuberl run` does before it starts",
    )
    config.set_defaults(func=_cmd_config)

    version = sub.add_parser("version", help="print the version")
    version.set_defaults(func=_cmd_version)

    for provider in COMMAND_PROVIDERS:
        try:
            module = importlib.import_module(f"kuberl.{provider}.cli")
        except ModuleNotFoundError as exc:
            if exc.name in (f"kuberl.{provider}", f"kuberl.{provider}.cli"):
                continue
            raise
        add: Callable[[argparse._SubParsersAction], None] = module.add_commands
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kuberl.common.config import ConfigError
    from kuberl.common.plugins import PluginError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # The job file and KEY=VALUE overrides may come after options too (`kuberl config check
    # --files job.yaml a=1`), where argparse has already closed the positional list.
    if extra and getattr(args, "config", "") is None and "=" not in extra[0]:
        args.config = extra.pop(0)
    if extra and (
        not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra)
    ):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return int(args.func(args) or 0)
    except (ConfigError, PluginError) as exc:
        print(f"kuberl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
