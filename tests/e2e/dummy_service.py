"""A do-nothing service under kuberl's real server bootstrap, for the supervisor's unit tests.

It listens (writing its port file), reports SERVING after `--ready-delay`, and can misbehave on
purpose: crash at start or after a while, but only for its first `--crash-times` starts (counted
in a file), so the tests can watch restarts. `DUMMY_PORT` pins the port, the way the supervisor
pins a restarted service's port through its `KUBERL_<SECTION>__SERVER__PORT` variable.

    python tests/e2e/dummy_service.py --port-file F [--ready-delay S] [--crash-at start|serving]
        [--crash-times N] [--counter FILE] [--exit-code C]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from kuberl.common.config import ServerConfig
from kuberl.common.logs import get_logger, setup_logging
from kuberl.common.server import Service, serve

log = get_logger("dummy")


class DummyService(Service):
    name = "dummy"

    def __init__(self, ready_delay: float, crash_after: float | None, exit_code: int) -> None:
        self.ready_delay = ready_delay
        self.crash_after = crash_after
        self.exit_code = exit_code

    async def start(self) -> None:
        await asyncio.sleep(self.ready_delay)
        if self.crash_after is not None:
            asyncio.get_running_loop().call_later(self.crash_after, self._crash)

    def _crash(self) -> None:
        log.error("dummy.crash", reason="crash requested by the test", code=self.exit_code)
        sys.stderr.flush()
        os._exit(self.exit_code)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--ready-delay", type=float, default=0.0)
    parser.add_argument("--crash-at", choices=("start", "serving"))
    parser.add_argument("--crash-times", type=int, default=1 << 30)
    parser.add_argument("--counter", help="file counting the starts")
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args()
    setup_logging("dummy")
    starts = 1
    if args.counter:
        counter = Path(args.counter)
        starts = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(starts))
    crash = args.crash_at if starts <= args.crash_times else None
    log.info("dummy.start", start=starts, crash=crash or "no")
    if crash == "start":
        log.error("dummy.crash", reason="cannot open the model folder", code=args.exit_code)
        sys.exit(args.exit_code)
    config = ServerConfig(
        host="127.0.0.1", port=int(os.environ.get("DUMMY_PORT", "0")), grace_seconds=2.0
    )
    service = DummyService(args.ready_delay, 0.5 if crash == "serving" else None, args.exit_code)
    asyncio.run(serve(service, config, port_file=args.port_file))


if __name__ == "__main__":
    main()
