"""The buffer's cache of the group bytes a replica accepted (kuberl.buffer.cache)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from kuberl.buffer.cache import PayloadCache


def _count(result: str) -> float:
    return REGISTRY.get_sample_value("kuberl_buffer_payload_cache_total", {"result": result}) or 0


def test_a_taken_payload_leaves_the_cache_and_a_second_take_misses() -> None:
    cache = PayloadCache(100)
    payload = memoryview(b"abcdefgh")[2:6]
    cache.add("k", payload)
    hits, misses = _count("hit"), _count("miss")
    assert (len(cache), cache.nbytes) == (1, 4)
    assert cache.take("k") is payload
    assert cache.take("k") is None
    assert (len(cache), cache.nbytes) == (0, 0)
    assert (_count("hit") - hits, _count("miss") - misses) == (1, 1)


def test_the_oldest_payloads_are_evicted_beyond_the_byte_bound() -> None:
    cache = PayloadCache(10)
    evicted = _count("evicted")
    for key in "abcd":
        cache.add(key, key.encode() * 4)  # 4 bytes each: two fit
    assert (len(cache), cache.nbytes) == (2, 8)
    assert (cache.take("a"), cache.take("b")) == (None, None)
    assert (cache.take("c"), cache.take("d")) == (b"cccc", b"dddd")
    assert _count("evicted") - evicted == 2


def test_what_cannot_fit_is_not_kept_and_a_zero_bound_keeps_nothing() -> None:
    big = PayloadCache(3)
    big.add("k", b"four")
    off = PayloadCache(0)
    off.add("k", b"x")
    assert (len(big), len(off), off.take("k")) == (0, 0, None)


def test_a_discarded_or_replaced_key_frees_its_bytes() -> None:
    cache = PayloadCache(100)
    cache.add("k", b"12345")
    cache.add("k", b"12")
    assert cache.nbytes == 2
    cache.discard("k")
    cache.discard("never-there")
    assert (len(cache), cache.nbytes) == (0, 0)
