"""A buffer filter for the CI chaos job (`buffer.filters`): drops the groups of every seventh
prompt of the dataset, so the chaos accounting must find those prompts filtered with the reason
`filter:tests.reliability.chaos_filter:every_seventh` rather than lost."""

from __future__ import annotations

from kuberl.common.trajectory import Group


def every_seventh(group: Group) -> bool:
    """Keep a group unless its prompt's row number is a multiple of 7."""
    return int(group.prompt_id.rsplit(":", 1)[1]) % 7 != 0
