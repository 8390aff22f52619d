"""Local mode: `kuberl run job.yaml` runs a whole job on one machine.

The supervisor (`kuberl.local.supervisor`) starts an embedded Redis and every service as its own
OS process with the container entrypoint (`kuberl serve <service>`), on loopback ports, watches
them (`kuberl.local.procs`), shows live progress (`kuberl.local.progress`) and writes a run folder
with logs, metrics, a summary and plots (`kuberl.local.report`). `kuberl.local.arith` is the demo's
task: seeded arithmetic problems with held-out eval prompts.
"""
