from kuberl.api.common.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STATUS_UNSPECIFIED: _ClassVar[PutStatus]
    PUT_STATUS_ACCEPTED: _ClassVar[PutStatus]
    PUT_STATUS_DUPLICATE: _ClassVar[PutStatus]
PUT_STATUS_UNSPECIFIED: PutStatus
PUT_STATUS_ACCEPTED: PutStatus
PUT_STATUS_DUPLICATE: PutStatus

class ColumnMapping(_message.Message):
    __slots__ = ("prompt", "answer", "metadata")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    answer: str
    metadata: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt: _Optional[str] = ..., answer: _Optional[str] = ..., metadata: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadDatasetRequest(_message.Message):
    __slots__ = ("path", "name", "columns", "kind", "num_epochs", "seed", "limit")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    path: str
    name: str
    columns: ColumnMapping
    kind: _trajectory_pb2.StreamKind
    num_epochs: int
    seed: int
    limit: int
    def __init__(self, path: _Optional[str] = ..., name: _Optional[str] = ..., columns: _Optional[_Union[ColumnMapping, _Mapping]] = ..., kind: _Optional[_Union[_trajectory_pb2.StreamKind, str]] = ..., num_epochs: _Optional[int] = ..., seed: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class LoadDatasetResponse(_message.Message):
    __slots__ = ("num_prompts", "loaded")
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    num_prompts: int
    loaded: bool
    def __init__(self, num_prompts: _Optional[int] = ..., loaded: _Optional[bool] = ...) -> None: ...

class LeasePromptsRequest(_message.Message):
    __slots__ = ("max_prompts", "consumer", "kind", "wait_seconds")
    MAX_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_prompts: int
    consumer: str
    kind: _trajectory_pb2.StreamKind
    wait_seconds: float
    def __init__(self, max_prompts: _Optional[int] = ..., consumer: _Optional[str] = ..., kind: _Optional[_Union[_trajectory_pb2.StreamKind, str]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class LeasePromptsResponse(_message.Message):
    __slots__ = ("prompts", "policy_version", "exhausted")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Prompt]
    policy_version: int
    exhausted: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[_trajectory_pb2.Prompt, _Mapping]]] = ..., policy_version: _Optional[int] = ..., exhausted: _Optional[bool] = ...) -> None: ...

class ReleasePromptsRequest(_message.Message):
    __slots__ = ("lease_ids", "consumer", "kind")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    consumer: str
    kind: _trajectory_pb2.StreamKind
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., consumer: _Optional[str] = ..., kind: _Optional[_Union[_trajectory_pb2.StreamKind, str]] = ...) -> None: ...

class ReleasePromptsResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class PutTrajectoriesRequest(_message.Message):
    __slots__ = ("groups", "consumer", "kind", "lease_ids")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Group]
    consumer: str
    kind: _trajectory_pb2.StreamKind
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, groups: _Optional[_Iterable[_Union[_trajectory_pb2.Group, _Mapping]]] = ..., consumer: _Optional[str] = ..., kind: _Optional[_Union[_trajectory_pb2.StreamKind, str]] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PutResult(_message.Message):
    __slots__ = ("group_id", "status")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    status: PutStatus
    def __init__(self, group_id: _Optional[str] = ..., status: _Optional[_Union[PutStatus, str]] = ...) -> None: ...

class PutTrajectoriesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("num_groups", "max_staleness", "current_version", "consumer", "wait_seconds", "kind", "ack_batch_id", "hold", "reopen_held")
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ACK_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    REOPEN_HELD_FIELD_NUMBER: _ClassVar[int]
    num_groups: int
    max_staleness: int
    current_version: int
    consumer: str
    wait_seconds: float
    kind: _trajectory_pb2.StreamKind
    ack_batch_id: str
    hold: bool
    reopen_held: bool
    def __init__(self, num_groups: _Optional[int] = ..., max_staleness: _Optional[int] = ..., current_version: _Optional[int] = ..., consumer: _Optional[str] = ..., wait_seconds: _Optional[float] = ..., kind: _Optional[_Union[_trajectory_pb2.StreamKind, str]] = ..., ack_batch_id: _Optional[str] = ..., hold: _Optional[bool] = ..., reopen_held: _Optional[bool] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("batch_id", "groups", "dropped", "redelivered", "exhausted", "ack_already_acked")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    ACK_ALREADY_ACKED_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    groups: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Group]
    dropped: _containers.ScalarMap[str, int]
    redelivered: bool
    exhausted: bool
    ack_already_acked: bool
    def __init__(self, batch_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_trajectory_pb2.Group, _Mapping]]] = ..., dropped: _Optional[_Mapping[str, int]] = ..., redelivered: _Optional[bool] = ..., exhausted: _Optional[bool] = ..., ack_already_acked: _Optional[bool] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("batch_id", "hold")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    hold: bool
    def __init__(self, batch_id: _Optional[str] = ..., hold: _Optional[bool] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("already_acked",)
    ALREADY_ACKED_FIELD_NUMBER: _ClassVar[int]
    already_acked: bool
    def __init__(self, already_acked: _Optional[bool] = ...) -> None: ...

class SetPolicyVersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SetPolicyVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("job", "policy_version", "epoch", "cursor", "prompts_total", "prompts_leased", "groups_pending", "batches_unacked", "counters", "exhausted", "batches_held", "groups_held")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_LEASED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PENDING_FIELD_NUMBER: _ClassVar[int]
    BATCHES_UNACKED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_HELD_FIELD_NUMBER: _ClassVar[int]
    GROUPS_HELD_FIELD_NUMBER: _ClassVar[int]
    job: str
    policy_version: int
    epoch: int
    cursor: int
    prompts_total: int
    prompts_leased: int
    groups_pending: int
    batches_unacked: int
    counters: _containers.ScalarMap[str, int]
    exhausted: bool
    batches_held: int
    groups_held: int
    def __init__(self, job: _Optional[str] = ..., policy_version: _Optional[int] = ..., epoch: _Optional[int] = ..., cursor: _Optional[int] = ..., prompts_total: _Optional[int] = ..., prompts_leased: _Optional[int] = ..., groups_pending: _Optional[int] = ..., batches_unacked: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., exhausted: _Optional[bool] = ..., batches_held: _Optional[int] = ..., groups_held: _Optional[int] = ...) -> None: ...

class StartEvalRequest(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class StartEvalResponse(_message.Message):
    __slots__ = ("rounds", "num_prompts", "started")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    num_prompts: int
    started: bool
    def __init__(self, rounds: _Optional[int] = ..., num_prompts: _Optional[int] = ..., started: _Optional[bool] = ...) -> None: ...
