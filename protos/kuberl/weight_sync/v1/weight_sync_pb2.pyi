from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_NCCL: _ClassVar[Transport]
    TRANSPORT_GLOO: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
    TRANSPORT_SNAPSHOT: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_NCCL: Transport
TRANSPORT_GLOO: Transport
TRANSPORT_CUDA_IPC: Transport
TRANSPORT_SNAPSHOT: Transport
TRANSPORT_SHM: Transport

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "bucket", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    bucket: int
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., bucket: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("tensors", "bucket_bytes", "total_bytes", "num_buckets")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    bucket_bytes: int
    total_bytes: int
    num_buckets: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., bucket_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_buckets: _Optional[int] = ...) -> None: ...

class BroadcastGroup(_message.Message):
    __slots__ = ("group_name", "backend", "master_address", "master_port", "world_size")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    backend: str
    master_address: str
    master_port: int
    world_size: int
    def __init__(self, group_name: _Optional[str] = ..., backend: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class UpdateInstruction(_message.Message):
    __slots__ = ("version", "transport", "manifest", "group", "rank", "snapshot_endpoint", "handles_json", "deadline_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HANDLES_JSON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    transport: Transport
    manifest: Manifest
    group: BroadcastGroup
    rank: int
    snapshot_endpoint: str
    handles_json: str
    deadline_seconds: float
    def __init__(self, version: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., group: _Optional[_Union[BroadcastGroup, _Mapping]] = ..., rank: _Optional[int] = ..., snapshot_endpoint: _Optional[str] = ..., handles_json: _Optional[str] = ..., deadline_seconds: _Optional[float] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "endpoint", "transports", "device", "host", "loaded_version", "last_seen_seconds", "ranks", "last_transport", "last_error", "gpu_uuid", "shm_in_place", "peer_endpoint")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    SHM_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    PEER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    endpoint: str
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    device: str
    host: str
    loaded_version: int
    last_seen_seconds: float
    ranks: int
    last_transport: Transport
    last_error: str
    gpu_uuid: str
    shm_in_place: bool
    peer_endpoint: str
    def __init__(self, engine_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., device: _Optional[str] = ..., host: _Optional[str] = ..., loaded_version: _Optional[int] = ..., last_seen_seconds: _Optional[float] = ..., ranks: _Optional[int] = ..., last_transport: _Optional[_Union[Transport, str]] = ..., last_error: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., shm_in_place: _Optional[bool] = ..., peer_endpoint: _Optional[str] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: EngineInfo
    def __init__(self, engine: _Optional[_Union[EngineInfo, _Mapping]] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id", "heartbeat_seconds", "pending", "current_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    heartbeat_seconds: float
    pending: UpdateInstruction
    current_version: int
    def __init__(self, engine_id: _Optional[str] = ..., heartbeat_seconds: _Optional[float] = ..., pending: _Optional[_Union[UpdateInstruction, _Mapping]] = ..., current_version: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id", "loaded_version", "wait_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    loaded_version: int
    wait_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., loaded_version: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("current_version", "pending", "known")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    pending: UpdateInstruction
    known: bool
    def __init__(self, current_version: _Optional[int] = ..., pending: _Optional[_Union[UpdateInstruction, _Mapping]] = ..., known: _Optional[bool] = ...) -> None: ...

class LeaveEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class LeaveEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportLoadedRequest(_message.Message):
    __slots__ = ("engine_id", "version", "ok", "error", "load_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    version: int
    ok: bool
    error: str
    load_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class ReportLoadedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("version", "manifest", "transports", "trainer_host", "gpu_uuid")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: Manifest
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    trainer_host: str
    gpu_uuid: str
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., trainer_host: _Optional[str] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version", "send", "upload_snapshot", "engine_ids", "cuda_ipc_engines")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_ENGINES_FIELD_NUMBER: _ClassVar[int]
    version: int
    send: UpdateInstruction
    upload_snapshot: bool
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    cuda_ipc_engines: int
    def __init__(self, version: _Optional[int] = ..., send: _Optional[_Union[UpdateInstruction, _Mapping]] = ..., upload_snapshot: _Optional[bool] = ..., engine_ids: _Optional[_Iterable[str]] = ..., cuda_ipc_engines: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("version", "offset", "data", "crc32c", "manifest", "sha256", "last", "cuda_ipc_handles_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLES_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    offset: int
    data: bytes
    crc32c: int
    manifest: Manifest
    sha256: str
    last: bool
    cuda_ipc_handles_json: str
    def __init__(self, version: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., sha256: _Optional[str] = ..., last: _Optional[bool] = ..., cuda_ipc_handles_json: _Optional[str] = ...) -> None: ...

class UploadSnapshotResponse(_message.Message):
    __slots__ = ("version", "bytes_received", "engine_ids")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_received: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitPublishRequest(_message.Message):
    __slots__ = ("version", "manifest", "sha256", "cuda_ipc_handles_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLES_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: Manifest
    sha256: str
    cuda_ipc_handles_json: str
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., sha256: _Optional[str] = ..., cuda_ipc_handles_json: _Optional[str] = ...) -> None: ...

class CommitPublishResponse(_message.Message):
    __slots__ = ("version", "engine_ids")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamSnapshotRequest(_message.Message):
    __slots__ = ("version", "engine_id", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    engine_id: str
    chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., engine_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("version", "manifest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: Manifest
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("current_version", "engines", "engines_per_version")
    class EnginesPerVersionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_PER_VERSION_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    engines_per_version: _containers.ScalarMap[int, int]
    def __init__(self, current_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., engines_per_version: _Optional[_Mapping[int, int]] = ...) -> None: ...
