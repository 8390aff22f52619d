from kuberl.api.weight_sync.v1 import weight_sync_pb2 as _weight_sync_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_STARTING: _ClassVar[ReplicaState]
    REPLICA_STATE_RUNNING: _ClassVar[ReplicaState]
    REPLICA_STATE_PAUSED: _ClassVar[ReplicaState]
    REPLICA_STATE_UPDATING_WEIGHTS: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_STARTING: ReplicaState
REPLICA_STATE_RUNNING: ReplicaState
REPLICA_STATE_PAUSED: ReplicaState
REPLICA_STATE_UPDATING_WEIGHTS: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("replica_id", "engine", "state", "policy_version", "prompts_in_flight", "groups_put", "generated_tokens")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PUT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    engine: str
    state: ReplicaState
    policy_version: int
    prompts_in_flight: int
    groups_put: int
    generated_tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., engine: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., policy_version: _Optional[int] = ..., prompts_in_flight: _Optional[int] = ..., groups_put: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("abort_in_flight",)
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    abort_in_flight: bool
    def __init__(self, abort_in_flight: _Optional[bool] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("finished", "released")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    finished: int
    released: int
    def __init__(self, finished: _Optional[int] = ..., released: _Optional[int] = ...) -> None: ...

class NotifyWeightsUpdateRequest(_message.Message):
    __slots__ = ("instruction",)
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    instruction: _weight_sync_pb2.UpdateInstruction
    def __init__(self, instruction: _Optional[_Union[_weight_sync_pb2.UpdateInstruction, _Mapping]] = ...) -> None: ...

class NotifyWeightsUpdateResponse(_message.Message):
    __slots__ = ("accepted", "policy_version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    policy_version: int
    def __init__(self, accepted: _Optional[bool] = ..., policy_version: _Optional[int] = ...) -> None: ...
