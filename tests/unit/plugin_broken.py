"""A plugin module whose import fails, for tests/unit/test_plugins.py."""

raise RuntimeError("this plugin cannot be imported")
