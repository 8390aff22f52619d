"""Prometheus metrics of the buffer service (names per docs/architecture.md and DESIGN.md).

Counters count what this replica did; gauges describe the whole job (read from Redis every few
seconds by each replica, so any replica can be scraped). Request counts, errors by status code and
latency per RPC are `kuberl_buffer_rpc_requests_total`, `kuberl_buffer_rpc_errors_total` and
`kuberl_buffer_rpc_seconds` from the shared server bootstrap.
"""

from __future__ import annotations

from kuberl.common import metrics

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)

GROUPS_PENDING = metrics.gauge(
    "kuberl_buffer_groups_pending",
    "Groups accepted and waiting for the trainer (not in any batch)",
    ["kind"],
)
GROUPS_IN_BATCHES = metrics.gauge(
    "kuberl_buffer_groups_in_batches",
    "Groups handed to the trainer in batches not yet acknowledged (nor held)",
    ["kind"],
)
GROUPS_HELD = metrics.gauge(
    "kuberl_buffer_groups_held",
    "Groups of trained batches the trainer holds until its next checkpoint",
    ["kind"],
)
BATCHES_HELD = metrics.gauge(
    "kuberl_buffer_batches_held",
    "Trained batches the trainer holds until its next checkpoint",
    ["kind"],
)
PROMPTS_LEASED = metrics.gauge(
    "kuberl_buffer_prompts_leased", "Prompts leased to rollout and not yet completed", ["kind"]
)
BATCHES_UNACKED = metrics.gauge(
    "kuberl_buffer_batches_unacked", "Batches handed out and not yet acknowledged", ["kind"]
)
POLICY_VERSION = metrics.gauge("kuberl_buffer_policy_version", "The job's current policy version")

LEASES_TOTAL = metrics.counter(
    "kuberl_buffer_leases_total",
    "Prompts handed out, by delivery (first, redelivery after an expired or released lease)",
    ["kind", "delivery"],
)
PROMPTS_RELEASED_TOTAL = metrics.counter(
    "kuberl_buffer_prompts_released_total", "Leases given back unfinished", ["kind"]
)
LEASES_REFUSED_TOTAL = metrics.counter(
    "kuberl_buffer_leases_refused_total", "LeasePrompts refused by backpressure", ["kind"]
)
LEASE_WAIT_SECONDS = metrics.histogram(
    "kuberl_buffer_lease_wait_seconds",
    "Time a LeasePrompts call was held at the buffer for room in the in-flight window "
    "(wait_seconds; 0 when there was room at once)",
    ["kind"],
)
GROUPS_PUT_TOTAL = metrics.counter(
    "kuberl_buffer_groups_put_total",
    "Groups put, by result (accepted, duplicate, rejected)",
    ["kind", "result"],
)
REJECTIONS_TOTAL = metrics.counter(
    "kuberl_buffer_rejections_total",
    "Requests refused as invalid, by method and reason",
    ["method", "reason"],
)
GROUPS_DELIVERED_TOTAL = metrics.counter(
    "kuberl_buffer_groups_delivered_total", "Groups handed to the trainer in new batches", ["kind"]
)
BATCHES_TOTAL = metrics.counter(
    "kuberl_buffer_batches_total",
    "Batches handed out, by delivery (new, redelivered)",
    ["kind", "delivery"],
)
ACKS_TOTAL = metrics.counter(
    "kuberl_buffer_acks_total",
    "Acknowledgements, by result (acked, already_acked, held, already_held)",
    ["kind", "result"],
)
GROUPS_DROPPED_TOTAL = metrics.counter(
    "kuberl_buffer_groups_dropped_total",
    "Groups dropped while assembling batches, by reason (stale, zero_variance, filter:<name>)",
    ["kind", "reason"],
)
FILTER_ERRORS_TOTAL = metrics.counter(
    "kuberl_buffer_filter_errors_total", "Custom filter calls that raised (group kept)", ["filter"]
)
STALENESS = metrics.histogram(
    "kuberl_buffer_staleness_versions",
    "Policy versions between a delivered group's oldest sample and the trainer's version",
    ["kind"],
    buckets=STALENESS_BUCKETS,
)
PAYLOAD_CACHE_TOTAL = metrics.counter(
    "kuberl_buffer_payload_cache_total",
    "Group bytes a batch found in this replica's cache of the groups it accepted (hit) or read "
    "from Redis (miss), and cached bytes evicted unread for room (evicted)",
    ["result"],
)
PAYLOAD_CACHE_BYTES = metrics.gauge(
    "kuberl_buffer_payload_cache_bytes",
    "Bytes of accepted groups this replica holds in memory until a batch takes them",
)
