"""kuberl.reward: the reward service. It scores finished samples for rollout replicas.

`server.py` is the gRPC `RewardService` (Score, ListVerifiers) that `kuberl serve reward` runs;
`scorer.py` combines verifiers per job and per sample, with timeouts and fallbacks; `pool.py`
runs CPU-bound verifiers in worker processes (`worker.py`) that are killed and replaced when they
hang; generated code runs in the shared sandbox (`kuberl.common.sandbox`); `verifiers/` holds
the built-in verifiers; `cli.py` adds `kuberl reward score`. See docs/reward.md.
"""
