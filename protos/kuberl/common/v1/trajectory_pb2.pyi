from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TURN_LIMIT: _ClassVar[FinishReason]

class StreamKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_KIND_UNSPECIFIED: _ClassVar[StreamKind]
    STREAM_KIND_TRAIN: _ClassVar[StreamKind]
    STREAM_KIND_EVAL: _ClassVar[StreamKind]
    STREAM_KIND_SFT: _ClassVar[StreamKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TURN_LIMIT: FinishReason
STREAM_KIND_UNSPECIFIED: StreamKind
STREAM_KIND_TRAIN: StreamKind
STREAM_KIND_EVAL: StreamKind
STREAM_KIND_SFT: StreamKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_seconds", "generate_seconds", "score_seconds", "finished_unix")
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    queued_seconds: float
    generate_seconds: float
    score_seconds: float
    finished_unix: float
    def __init__(self, queued_seconds: _Optional[float] = ..., generate_seconds: _Optional[float] = ..., score_seconds: _Optional[float] = ..., finished_unix: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "prompt_id", "epoch", "sample_index", "prompt_token_ids", "response_token_ids", "rollout_logprobs", "loss_mask", "reward", "reward_breakdown", "finish_reason", "policy_version_start", "policy_version_end", "timings", "metadata_json", "response_text")
    class RewardBreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_START_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_END_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    prompt_id: str
    epoch: int
    sample_index: int
    prompt_token_ids: Tensor
    response_token_ids: Tensor
    rollout_logprobs: Tensor
    loss_mask: Tensor
    reward: float
    reward_breakdown: _containers.ScalarMap[str, float]
    finish_reason: FinishReason
    policy_version_start: int
    policy_version_end: int
    timings: Timings
    metadata_json: str
    response_text: str
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., epoch: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., loss_mask: _Optional[_Union[Tensor, _Mapping]] = ..., reward: _Optional[float] = ..., reward_breakdown: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version_start: _Optional[int] = ..., policy_version_end: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., metadata_json: _Optional[str] = ..., response_text: _Optional[str] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "prompt_id", "epoch", "trajectories")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    epoch: int
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., epoch: _Optional[int] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "epoch", "text", "answer", "metadata_json", "lease_id", "delivery_count")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    epoch: int
    text: str
    answer: str
    metadata_json: str
    lease_id: str
    delivery_count: int
    def __init__(self, prompt_id: _Optional[str] = ..., epoch: _Optional[int] = ..., text: _Optional[str] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., lease_id: _Optional[str] = ..., delivery_count: _Optional[int] = ...) -> None: ...
