from kuberl.api.common.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sample(_message.Message):
    __slots__ = ("sample_id", "prompt", "response", "response_token_ids", "answer", "metadata_json", "verifiers", "finish_reason")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt: str
    response: str
    response_token_ids: _trajectory_pb2.Tensor
    answer: str
    metadata_json: str
    verifiers: _containers.RepeatedScalarFieldContainer[str]
    finish_reason: _trajectory_pb2.FinishReason
    def __init__(self, sample_id: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[str] = ..., response_token_ids: _Optional[_Union[_trajectory_pb2.Tensor, _Mapping]] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., verifiers: _Optional[_Iterable[str]] = ..., finish_reason: _Optional[_Union[_trajectory_pb2.FinishReason, str]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class SampleScore(_message.Message):
    __slots__ = ("sample_id", "reward", "breakdown", "error", "details")
    class BreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    reward: float
    breakdown: _containers.ScalarMap[str, float]
    error: str
    details: str
    def __init__(self, sample_id: _Optional[str] = ..., reward: _Optional[float] = ..., breakdown: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[SampleScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[SampleScore, _Mapping]]] = ...) -> None: ...

class ListVerifiersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("name", "description", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class ListVerifiersResponse(_message.Message):
    __slots__ = ("verifiers",)
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    verifiers: _containers.RepeatedCompositeFieldContainer[VerifierInfo]
    def __init__(self, verifiers: _Optional[_Iterable[_Union[VerifierInfo, _Mapping]]] = ...) -> None: ...
