"""kuberl: reinforcement-learning post-training for LLMs as Kubernetes-native microservices.

Each subpackage is one deployable service (`kuberl.buffer`, `kuberl.rollout`, `kuberl.reward`,
`kuberl.trainer`, `kuberl.weight_sync`) or the local supervisor (`kuberl.local`), plus
`kuberl.common`, the runtime they share, and `kuberl.api`, the generated gRPC contracts.
Services meet only in `kuberl.api` and `kuberl.common` (tests/unit/test_boundaries.py holds the
rule and enforces it).
"""

__version__ = "0.1.0"
