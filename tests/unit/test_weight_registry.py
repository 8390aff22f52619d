"""The weight-sync engine registry: liveness by heartbeat with a hand-driven clock."""

from __future__ import annotations

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.weight_sync.registry import Registry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _registry() -> tuple[Registry, Clock]:
    clock = Clock()
    return Registry(heartbeat_seconds=2.0, missed_heartbeats=3, clock=clock), clock


def test_an_engine_silent_for_more_than_the_missed_heartbeats_expires() -> None:
    registry, clock = _registry()
    registry.register(pb.EngineInfo(engine_id="a"))
    clock.now += 5.9
    early = [e.engine_id for e in registry.expired()]
    clock.now += 0.2  # 6.1 s > 2 s * 3
    assert (early, [e.engine_id for e in registry.expired()]) == ([], ["a"])


def test_an_engine_holding_a_long_poll_open_is_alive() -> None:
    registry, clock = _registry()
    engine, _ = registry.register(pb.EngineInfo(engine_id="a"))
    engine.polls = 1
    clock.now += 60
    assert registry.expired() == []


def test_engines_per_version_counts_what_each_engine_holds() -> None:
    registry, _ = _registry()
    for name, version in (("a", 3), ("b", 3), ("c", 2)):
        registry.register(pb.EngineInfo(engine_id=name, loaded_version=version))
    assert registry.engines_per_version() == {3: 2, 2: 1}


def test_registering_again_replaces_the_engine_and_an_empty_id_gets_one() -> None:
    registry, _ = _registry()
    _, first = registry.register(pb.EngineInfo(engine_id="a", loaded_version=1))
    again, second = registry.register(pb.EngineInfo(engine_id="a", loaded_version=4))
    anonymous, _ = registry.register(pb.EngineInfo())
    assert (first, second, again.loaded_version) == (True, False, 4)
    assert anonymous.engine_id.startswith("engine-") and len(registry.engines) == 2


def test_an_sglang_engine_registers_one_rank_per_tensor_parallel_rank() -> None:
    # The relay sizes each broadcast group as 1 + ranks; SGLang joins with rank_offset + tp_rank.
    from kuberl.common.weights import EngineClient

    sent: list[pb.RegisterEngineRequest] = []

    class Stub:
        def RegisterEngine(self, request, timeout):  # the gRPC method's name
            sent.append(request)
            return pb.RegisterEngineResponse(engine_id="e1")

    client = EngineClient("127.0.0.1:1", apply=lambda _: None, transports=("nccl",), ranks=2)
    client._stub = Stub()  # type: ignore[assignment]
    client.register()
    registry, _ = _registry()
    engine, _ = registry.register(sent[0].engine)
    assert (sent[0].engine.ranks, engine.ranks) == (2, 2)


def test_publish_asks_for_a_cuda_ipc_set_only_per_engine_the_fan_out_would_give_one(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    # A set nobody opens keeps the trainer's GPU memory behind it allocated, so the count
    # follows the fan-out's own rule: idle colocated engines that are neither overdue nor
    # catching up (those get a snapshot) nor busy (they get nothing).
    import asyncio

    from kuberl.common.config import WeightSyncConfig
    from kuberl.weight_sync.registry import Assignment
    from kuberl.weight_sync.server import WeightSyncService
    from kuberl.weight_sync.store import VersionStore

    service = WeightSyncService(WeightSyncConfig(transports=["cuda_ipc", "snapshot"]))
    service.store = VersionStore(tmp_path / "store", 2)
    ipc = [pb.TRANSPORT_CUDA_IPC, pb.TRANSPORT_SNAPSHOT]
    for name in ("idle", "overdue", "catching-up", "busy", "other-gpu"):
        gpu = "GPU-other" if name == "other-gpu" else "GPU-0"
        info = pb.EngineInfo(engine_id=name, transports=ipc, host="h", gpu_uuid=gpu)
        service.registry.register(info)
    engines = service.registry.engines
    late = Assignment(pb.UpdateInstruction(version=1), started=0.0, deadline=1.0)
    engines["overdue"].overdue = late
    engines["catching-up"].catch_up_below = 3
    engines["busy"].assignment = late
    request = pb.PublishRequest(
        version=2, transports=ipc, trainer_host="h", gpu_uuid="GPU-0"
    )  # fmt: skip
    answer = asyncio.run(service.Publish(request, None))  # type: ignore[arg-type]
    assert answer.cuda_ipc_engines == 1


def test_engines_are_counted_in_five_buckets_of_versions_behind_the_current_one() -> None:
    from kuberl.weight_sync.server import BEHIND_BUCKETS, behind_bucket

    buckets = [behind_bucket(n) for n in (-2, -1, 0, 1, 2, 3, 4, 1000)]
    assert buckets == ["ahead", "ahead", "0", "1", "2", "3+", "3+", "3+"]
    assert set(buckets) == set(BEHIND_BUCKETS)
