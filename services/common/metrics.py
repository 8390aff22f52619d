"""Prometheus metrics for every kuberl process.

Names follow `kuberl_<service>_<thing>_<unit>`: counters end in `_total`, durations are
`_seconds` histograms; rates are PromQL's job, never the service's. Each process serves its own
`/metrics` with `start_metrics_server`. Metric objects are created once per process through
`counter` / `gauge` / `histogram`, which return the existing object when a name is asked again
(tests and supervisors may build several services in one interpreter).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

# Latency buckets from 1 ms to 10 min, covering an RPC as well as a training step.
SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)

# An RPC's latency: steps of at most 1.5x from 1 to 100 ms, where a call's p99 goal (50 ms at
# scale, docs/scale.md) must be readable, then SECONDS_BUCKETS' coarse steps up to 10 min.
RPC_SECONDS_BUCKETS = (
    *(0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075),
    *(0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1),
    *(b for b in SECONDS_BUCKETS if b > 0.1),
)

_lock = threading.Lock()
_metrics: dict[str, Any] = {}


def _get(kind: type, name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
    with _lock:
        existing = _metrics.get(name)
        if existing is not None:
            if not isinstance(existing, kind):
                raise ValueError(f"metric {name} already exists as a {type(existing).__name__}")
            return existing
        metric = kind(name, doc, labelnames=tuple(labels), **kw)
        _metrics[name] = metric
        return metric


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    if not name.endswith("_total"):
        raise ValueError(f"counter {name} must end in _total")
    # prometheus_client appends _total itself.
    return _get(Counter, name, doc, labels)


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    return _get(Gauge, name, doc, labels)


def histogram(
    name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = SECONDS_BUCKETS
) -> Histogram:
    return _get(Histogram, name, doc, labels, buckets=tuple(buckets))


def start_metrics_server(port: int, host: str = "0.0.0.0") -> int:
    """Serve /metrics on port (0 = a free one); return the port actually bound."""
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_port)
