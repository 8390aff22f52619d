"""Callables that tests/unit/test_plugins.py loads by dotted path."""

NOT_CALLABLE = 3


def one_arg(sample):
    return 1.0


def two_args(a, b):
    return a + b


def with_default(sample, scale=2.0):
    return scale


class Holder:
    @staticmethod
    def method(sample):
        return 0.5


class _TwoArgs:
    def __call__(self, a, b):  # type: ignore[no-untyped-def]
        return 0.0


TWO_ARG_OBJECT = _TwoArgs()  # a callable object: no __name__
