"""kuberl: reinforcement-learning post-training for LLMs as Kubernetes-native microservices.

Each subpackage is one deployable service (`kuberl.buffer`, `kuberl.rollout`, `kuberl.reward`,
`kuberl.trainer`, `kuberl.weight_sync`) plus `kuberl.common`, the runtime they share, and
`kuberl.api`, the generated gRPC contracts. Services meet only through `kuberl.api`.
"""

__version__ = "0.1.0"
