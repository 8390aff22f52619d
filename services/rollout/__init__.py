"""The rollout service (`kuberl serve rollout`): replicas that turn prompts into scored groups.

`engine/` holds the engines (`torch` in-process, `sglang` HTTP client), `worker.py` the
lease -> generate -> score -> put loop, `functions.py` / `multiturn.py` / `tools.py` the rollout
functions, `server.py` the service and its control API. docs/rollout.md is the user guide.
"""
