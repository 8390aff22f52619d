"""The image-test harness's own rules that need no root: the kubelet's `$(VAR)` expansion and
the content tag that decides whether `make images` rebuilds an image."""

from __future__ import annotations

from tests.images.build import REPO, ImageSpec
from tests.images.pods import expand


def test_expand_replaces_defined_variables_and_keeps_the_rest_as_kubernetes_does() -> None:
    env = {"POD_IP": "10.0.0.7", "POD_NAME": "rl-kuberl-rollout-x"}
    assert expand("$(POD_IP)", env) == "10.0.0.7"
    assert expand("id-$(POD_NAME)-$(MISSING)", env) == "id-rl-kuberl-rollout-x-$(MISSING)"
    assert expand("$$(POD_IP) costs $$5", env) == "$(POD_IP) costs $5"


def test_an_image_tag_changes_with_its_build_arguments_and_only_then() -> None:
    dockerfile = REPO / "Dockerfiles" / "kuberl.Dockerfile"
    one = ImageSpec("kuberl", dockerfile, {"TORCH_REQUIREMENT": "torch==2.13.0"})
    same = ImageSpec("kuberl", dockerfile, {"TORCH_REQUIREMENT": "torch==2.13.0"})
    other = ImageSpec("kuberl", dockerfile, {"TORCH_REQUIREMENT": "torch==2.14.1"})
    assert one.tag("base-a") == same.tag("base-a")
    assert one.tag("base-a") != other.tag("base-a")
    assert one.tag("base-a") != one.tag("base-b")
    assert one.tag("base-a").startswith("localhost/kuberl:")
