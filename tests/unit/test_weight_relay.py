"""Weight-sync's relay tree (`kuberl.weight_sync.relay`): each source streams to at most
`fanout` engines at a time, engines that hold a version become sources of it, and engines that
serve nobody never wait."""

from __future__ import annotations

from kuberl.weight_sync.relay import SERVICE, Relay


def _relay(fanout: int, peers: int, servers: bool = True) -> Relay:
    relay = Relay(fanout)
    for i in range(peers):
        relay.join(f"e{i}", f"host:{9000 + i}" if servers else "")
    return relay


def test_the_service_streams_to_at_most_fanout_engines_and_the_rest_wait() -> None:
    relay = _relay(2, 4)
    got = [relay.source(f"e{i}", 1) for i in range(4)]
    assert got == [SERVICE, SERVICE, None, None]
    assert relay.waiting_count() == 2


def test_an_engine_that_loaded_the_version_serves_the_next_ones() -> None:
    relay = _relay(2, 4)
    for i in range(4):
        relay.source(f"e{i}", 1)
    relay.holds("e0", 1)
    assert relay.finished("e0") == SERVICE
    assert [relay.source(relay.next_waiting() or "", 1) for _ in range(2)] == [
        "host:9000",
        "host:9000",
    ]


def test_engines_that_serve_nobody_never_wait() -> None:
    relay = _relay(1, 3, servers=False)
    assert [relay.source(f"e{i}", 1) for i in range(3)] == [SERVICE] * 3


def test_fanout_zero_is_the_star() -> None:
    relay = _relay(0, 3)
    assert [relay.source(f"e{i}", 1) for i in range(3)] == [SERVICE] * 3


def test_a_peer_whose_download_failed_gets_no_more_downloaders() -> None:
    relay = _relay(1, 3)
    relay.source("e0", 1)
    relay.holds("e0", 1)
    relay.finished("e0")
    assert relay.source("e1", 1) == "host:9000"
    relay.failed_source(relay.finished("e1") or "")
    assert relay.source("e1", 1) == SERVICE  # not e0 again


def test_a_new_version_starts_a_new_tree_and_the_old_one_is_served_by_the_service() -> None:
    relay = _relay(1, 3)
    relay.source("e0", 1)
    relay.holds("e0", 1)
    relay.finished("e0")
    assert relay.source("e1", 2) == SERVICE  # e0 holds 1, not 2
    assert relay.source("e2", 1) == SERVICE  # 1 is no longer relayed


def test_the_tree_reaches_n_engines_in_log_rounds_the_service_streaming_fanout_at_once() -> None:
    # Rounds of equal transfers: every download started in a round ends before the next.
    n, fanout = 64, 2
    relay = _relay(fanout, n)
    pending = [f"e{i}" for i in range(n)]
    from_service, rounds = 0, 0
    while pending:
        rounds += 1
        started = [e for e in pending if relay.source(e, 1) is not None]
        from_service += sum(1 for e in started if relay.source_of(e) == SERVICE)
        for e in started:
            relay.holds(e, 1)
            relay.finished(e)
        pending = [e for e in pending if e not in started]
    # Sources triple per round (each serves 2 and keeps serving): 2, 8, 26, 80 engines; the
    # service streams 2 at a time, fewer once peers have the free slots.
    assert rounds == 4 and from_service <= fanout * rounds


def test_a_download_of_an_older_version_ending_frees_no_slot_of_the_newer_tree() -> None:
    relay = _relay(1, 4)
    relay.source("e0", 1)
    relay.holds("e0", 1)
    relay.finished("e0")
    assert relay.source("e1", 1) == "host:9000"  # e1 downloads version 1 from e0
    relay.source("e0", 2)  # version 2: e0 takes it from the service ...
    relay.holds("e0", 2)
    relay.finished("e0")
    assert relay.source("e2", 2) == "host:9000"  # ... and serves it, its one slot now full
    relay.finished("e1")  # e1's download of version 1 ends
    assert relay.source("e3", 2) == SERVICE  # e0's slot in version 2's tree is still taken
