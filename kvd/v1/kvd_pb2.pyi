from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KvLayout]
    KV_LAYOUT_NHD: _ClassVar[KvLayout]
    KV_LAYOUT_HND: _ClassVar[KvLayout]
    KV_LAYOUT_MLA: _ClassVar[KvLayout]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_SHM: _ClassVar[MemoryKind]
    MEMORY_KIND_CUDA_IPC: _ClassVar[MemoryKind]
    MEMORY_KIND_MEMFD: _ClassVar[MemoryKind]

class DataPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_PATH_AUTO: _ClassVar[DataPath]
    DATA_PATH_DIRECT: _ClassVar[DataPath]
    DATA_PATH_STAGED: _ClassVar[DataPath]

class PeerAuthMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_AUTH_UNSPECIFIED: _ClassVar[PeerAuthMode]
    PEER_AUTH_TOKEN: _ClassVar[PeerAuthMode]
    PEER_AUTH_MUTUAL_TLS: _ClassVar[PeerAuthMode]
    PEER_AUTH_MUTUAL_TLS_AND_TOKEN: _ClassVar[PeerAuthMode]
    PEER_AUTH_NONE_LOOPBACK: _ClassVar[PeerAuthMode]
    PEER_AUTH_NONE_INSECURE: _ClassVar[PeerAuthMode]
KV_LAYOUT_UNSPECIFIED: KvLayout
KV_LAYOUT_NHD: KvLayout
KV_LAYOUT_HND: KvLayout
KV_LAYOUT_MLA: KvLayout
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_SHM: MemoryKind
MEMORY_KIND_CUDA_IPC: MemoryKind
MEMORY_KIND_MEMFD: MemoryKind
DATA_PATH_AUTO: DataPath
DATA_PATH_DIRECT: DataPath
DATA_PATH_STAGED: DataPath
PEER_AUTH_UNSPECIFIED: PeerAuthMode
PEER_AUTH_TOKEN: PeerAuthMode
PEER_AUTH_MUTUAL_TLS: PeerAuthMode
PEER_AUTH_MUTUAL_TLS_AND_TOKEN: PeerAuthMode
PEER_AUTH_NONE_LOOPBACK: PeerAuthMode
PEER_AUTH_NONE_INSECURE: PeerAuthMode

class Segment(_message.Message):
    __slots__ = ("kind", "name", "size", "handle", "device", "fd_id", "device_uuid")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FD_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    kind: MemoryKind
    name: str
    size: int
    handle: bytes
    device: int
    fd_id: str
    device_uuid: bytes
    def __init__(self, kind: _Optional[_Union[MemoryKind, str]] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., handle: _Optional[bytes] = ..., device: _Optional[int] = ..., fd_id: _Optional[str] = ..., device_uuid: _Optional[bytes] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("segment_index", "offset", "block_len", "block_stride", "name", "group")
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    segment_index: int
    offset: int
    block_len: int
    block_stride: int
    name: str
    group: int
    def __init__(self, segment_index: _Optional[int] = ..., offset: _Optional[int] = ..., block_len: _Optional[int] = ..., block_stride: _Optional[int] = ..., name: _Optional[str] = ..., group: _Optional[int] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("num_blocks", "block_size", "kv_layout", "dtype", "num_kv_heads", "head_dim", "num_layers", "block_lens", "total_kv_heads", "kv_in_block", "k_dim_major")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_IN_BLOCK_FIELD_NUMBER: _ClassVar[int]
    K_DIM_MAJOR_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    kv_layout: KvLayout
    dtype: str
    num_kv_heads: int
    head_dim: int
    num_layers: int
    block_lens: _containers.RepeatedScalarFieldContainer[int]
    total_kv_heads: int
    kv_in_block: bool
    k_dim_major: bool
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_layout: _Optional[_Union[KvLayout, str]] = ..., dtype: _Optional[str] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_layers: _Optional[int] = ..., block_lens: _Optional[_Iterable[int]] = ..., total_kv_heads: _Optional[int] = ..., kv_in_block: _Optional[bool] = ..., k_dim_major: _Optional[bool] = ...) -> None: ...

class EngineWorker(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "tp_size")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    tp_size: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("worker", "layout", "segments", "regions", "model", "compat_extra", "data_path", "owner_pid")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPAT_EXTRA_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    worker: EngineWorker
    layout: Layout
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    model: str
    compat_extra: str
    data_path: DataPath
    owner_pid: int
    def __init__(self, worker: _Optional[_Union[EngineWorker, _Mapping]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., model: _Optional[str] = ..., compat_extra: _Optional[str] = ..., data_path: _Optional[_Union[DataPath, str]] = ..., owner_pid: _Optional[int] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("agent_name", "peer_address", "compat_hash", "registered_bytes", "data_path", "staging_segments", "session_token")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    STAGING_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    peer_address: str
    compat_hash: str
    registered_bytes: int
    data_path: DataPath
    staging_segments: _containers.RepeatedCompositeFieldContainer[Segment]
    session_token: str
    def __init__(self, agent_name: _Optional[str] = ..., peer_address: _Optional[str] = ..., compat_hash: _Optional[str] = ..., registered_bytes: _Optional[int] = ..., data_path: _Optional[_Union[DataPath, str]] = ..., staging_segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., session_token: _Optional[str] = ...) -> None: ...

class UnregisterEngineRequest(_message.Message):
    __slots__ = ("worker", "session_token")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker: EngineWorker
    session_token: str
    def __init__(self, worker: _Optional[_Union[EngineWorker, _Mapping]] = ..., session_token: _Optional[str] = ...) -> None: ...

class UnregisterEngineResponse(_message.Message):
    __slots__ = ("released_leases",)
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    released_leases: int
    def __init__(self, released_leases: _Optional[int] = ...) -> None: ...

class SessionCommand(_message.Message):
    __slots__ = ("open", "load", "hold", "release", "abort_load")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ABORT_LOAD_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    load: LoadBlocks
    hold: HoldBlocks
    release: ReleaseBlocks
    abort_load: AbortLoad
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., load: _Optional[_Union[LoadBlocks, _Mapping]] = ..., hold: _Optional[_Union[HoldBlocks, _Mapping]] = ..., release: _Optional[_Union[ReleaseBlocks, _Mapping]] = ..., abort_load: _Optional[_Union[AbortLoad, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("worker", "session_token")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker: EngineWorker
    session_token: str
    def __init__(self, worker: _Optional[_Union[EngineWorker, _Mapping]] = ..., session_token: _Optional[str] = ...) -> None: ...

class LoadBlocks(_message.Message):
    __slots__ = ("request_id", "remote_engine_id", "remote_address", "remote_request_id", "remote_tp_size", "timeout_s", "local_groups", "remote_groups")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    remote_engine_id: str
    remote_address: str
    remote_request_id: str
    remote_tp_size: int
    timeout_s: float
    local_groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    remote_groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, request_id: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., remote_address: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_tp_size: _Optional[int] = ..., timeout_s: _Optional[float] = ..., local_groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., remote_groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class HoldBlocks(_message.Message):
    __slots__ = ("request_id", "lease_s", "groups")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_s: float
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, request_id: _Optional[str] = ..., lease_s: _Optional[float] = ..., groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class ReleaseBlocks(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortLoad(_message.Message):
    __slots__ = ("request_id", "remote_engine_id", "remote_address", "remote_request_id", "remote_tp_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    remote_engine_id: str
    remote_address: str
    remote_request_id: str
    remote_tp_size: int
    def __init__(self, request_id: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., remote_address: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_tp_size: _Optional[int] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "recv_done", "load_failed", "send_done", "rejected", "renewed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RECV_DONE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILED_FIELD_NUMBER: _ClassVar[int]
    SEND_DONE_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    recv_done: RecvDone
    load_failed: LoadFailed
    send_done: SendDone
    rejected: CommandRejected
    renewed: LeaseRenewed
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., recv_done: _Optional[_Union[RecvDone, _Mapping]] = ..., load_failed: _Optional[_Union[LoadFailed, _Mapping]] = ..., send_done: _Optional[_Union[SendDone, _Mapping]] = ..., rejected: _Optional[_Union[CommandRejected, _Mapping]] = ..., renewed: _Optional[_Union[LeaseRenewed, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("agent_name", "daemon_version", "transfer_timeout_s", "max_transfer_timeout_s")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    daemon_version: str
    transfer_timeout_s: float
    max_transfer_timeout_s: float
    def __init__(self, agent_name: _Optional[str] = ..., daemon_version: _Optional[str] = ..., transfer_timeout_s: _Optional[float] = ..., max_transfer_timeout_s: _Optional[float] = ...) -> None: ...

class RecvDone(_message.Message):
    __slots__ = ("request_id", "bytes", "num_blocks", "num_descriptors", "duration_s", "post_duration_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    POST_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    bytes: int
    num_blocks: int
    num_descriptors: int
    duration_s: float
    post_duration_s: float
    def __init__(self, request_id: _Optional[str] = ..., bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., duration_s: _Optional[float] = ..., post_duration_s: _Optional[float] = ...) -> None: ...

class LoadFailed(_message.Message):
    __slots__ = ("request_id", "failed_block_ids", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    failed_block_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., failed_block_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class SendDone(_message.Message):
    __slots__ = ("request_id", "expired", "released")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    expired: bool
    released: bool
    def __init__(self, request_id: _Optional[str] = ..., expired: _Optional[bool] = ..., released: _Optional[bool] = ...) -> None: ...

class CommandRejected(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("engines", "regions", "registered_bytes", "peers", "active_leases", "inflight_transfers", "bytes_read", "transfers_done", "transfers_failed", "leases_expired", "sessions", "uptime_s", "daemon_version", "peer_address", "leaked_handles", "remote_agents", "early_notifications", "pending_events", "prepped_dlists", "dlists_preparing", "quarantined_workers", "leases_renewed", "claims_sent", "claims_followed", "holds_followed", "claims_waited", "notifications_dropped", "holds_answers_applied", "holds_answers_sent", "coalesced_reads", "workers", "remote_workers", "data_path", "versions", "backends", "draining", "metrics_address", "warm_peers", "command_socket", "lease_s", "max_lease_life_s", "follow_holds", "warm_peers_configured", "peer_auth", "peer_listen", "transfer_mode", "vet_peer_metadata", "refuses_pushes")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_DONE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEAKED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_AGENTS_FIELD_NUMBER: _ClassVar[int]
    EARLY_NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREPPED_DLISTS_FIELD_NUMBER: _ClassVar[int]
    DLISTS_PREPARING_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_RENEWED_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_SENT_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FOLLOWED_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FOLLOWED_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_WAITED_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATIONS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    HOLDS_ANSWERS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    HOLDS_ANSWERS_SENT_FIELD_NUMBER: _ClassVar[int]
    COALESCED_READS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WARM_PEERS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_LIFE_S_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_HOLDS_FIELD_NUMBER: _ClassVar[int]
    WARM_PEERS_CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    PEER_AUTH_FIELD_NUMBER: _ClassVar[int]
    PEER_LISTEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    VET_PEER_METADATA_FIELD_NUMBER: _ClassVar[int]
    REFUSES_PUSHES_FIELD_NUMBER: _ClassVar[int]
    engines: int
    regions: int
    registered_bytes: int
    peers: int
    active_leases: int
    inflight_transfers: int
    bytes_read: int
    transfers_done: int
    transfers_failed: int
    leases_expired: int
    sessions: int
    uptime_s: float
    daemon_version: str
    peer_address: str
    leaked_handles: int
    remote_agents: int
    early_notifications: int
    pending_events: int
    prepped_dlists: int
    dlists_preparing: int
    quarantined_workers: int
    leases_renewed: int
    claims_sent: int
    claims_followed: int
    holds_followed: int
    claims_waited: int
    notifications_dropped: int
    holds_answers_applied: int
    holds_answers_sent: int
    coalesced_reads: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    remote_workers: _containers.RepeatedCompositeFieldContainer[PeerStats]
    data_path: str
    versions: _containers.ScalarMap[str, str]
    backends: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    metrics_address: str
    warm_peers: _containers.RepeatedCompositeFieldContainer[WarmPeerStats]
    command_socket: str
    lease_s: float
    max_lease_life_s: float
    follow_holds: bool
    warm_peers_configured: _containers.RepeatedScalarFieldContainer[str]
    peer_auth: PeerAuthMode
    peer_listen: str
    transfer_mode: str
    vet_peer_metadata: bool
    refuses_pushes: bool
    def __init__(self, engines: _Optional[int] = ..., regions: _Optional[int] = ..., registered_bytes: _Optional[int] = ..., peers: _Optional[int] = ..., active_leases: _Optional[int] = ..., inflight_transfers: _Optional[int] = ..., bytes_read: _Optional[int] = ..., transfers_done: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., leases_expired: _Optional[int] = ..., sessions: _Optional[int] = ..., uptime_s: _Optional[float] = ..., daemon_version: _Optional[str] = ..., peer_address: _Optional[str] = ..., leaked_handles: _Optional[int] = ..., remote_agents: _Optional[int] = ..., early_notifications: _Optional[int] = ..., pending_events: _Optional[int] = ..., prepped_dlists: _Optional[int] = ..., dlists_preparing: _Optional[int] = ..., quarantined_workers: _Optional[int] = ..., leases_renewed: _Optional[int] = ..., claims_sent: _Optional[int] = ..., claims_followed: _Optional[int] = ..., holds_followed: _Optional[int] = ..., claims_waited: _Optional[int] = ..., notifications_dropped: _Optional[int] = ..., holds_answers_applied: _Optional[int] = ..., holds_answers_sent: _Optional[int] = ..., coalesced_reads: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., remote_workers: _Optional[_Iterable[_Union[PeerStats, _Mapping]]] = ..., data_path: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ..., backends: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., metrics_address: _Optional[str] = ..., warm_peers: _Optional[_Iterable[_Union[WarmPeerStats, _Mapping]]] = ..., command_socket: _Optional[str] = ..., lease_s: _Optional[float] = ..., max_lease_life_s: _Optional[float] = ..., follow_holds: _Optional[bool] = ..., warm_peers_configured: _Optional[_Iterable[str]] = ..., peer_auth: _Optional[_Union[PeerAuthMode, str]] = ..., peer_listen: _Optional[str] = ..., transfer_mode: _Optional[str] = ..., vet_peer_metadata: _Optional[bool] = ..., refuses_pushes: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "tp_size", "model", "agent_name", "compat_hash", "regions", "num_blocks", "block_size", "registered_bytes", "active_leases", "inflight_transfers", "sessions", "peers", "memory", "data_path", "handover")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    tp_size: int
    model: str
    agent_name: str
    compat_hash: str
    regions: int
    num_blocks: int
    block_size: int
    registered_bytes: int
    active_leases: int
    inflight_transfers: int
    sessions: int
    peers: int
    memory: str
    data_path: str
    handover: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., model: _Optional[str] = ..., agent_name: _Optional[str] = ..., compat_hash: _Optional[str] = ..., regions: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., registered_bytes: _Optional[int] = ..., active_leases: _Optional[int] = ..., inflight_transfers: _Optional[int] = ..., sessions: _Optional[int] = ..., peers: _Optional[int] = ..., memory: _Optional[str] = ..., data_path: _Optional[str] = ..., handover: _Optional[str] = ...) -> None: ...

class PeerStats(_message.Message):
    __slots__ = ("address", "engine_id", "tp_rank", "tp_size", "agent_name", "daemon_version", "local_engine_id", "local_tp_rank", "read_transport", "loads")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    READ_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    address: str
    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    daemon_version: str
    local_engine_id: str
    local_tp_rank: int
    read_transport: str
    loads: str
    def __init__(self, address: _Optional[str] = ..., engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., agent_name: _Optional[str] = ..., daemon_version: _Optional[str] = ..., local_engine_id: _Optional[str] = ..., local_tp_rank: _Optional[int] = ..., read_transport: _Optional[str] = ..., loads: _Optional[str] = ...) -> None: ...

class WarmPeerStats(_message.Message):
    __slots__ = ("address", "engine_id", "local_engine_id", "local_tp_rank", "state", "state_for_s", "tries", "last_error", "paired_ranks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_FOR_S_FIELD_NUMBER: _ClassVar[int]
    TRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PAIRED_RANKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    engine_id: str
    local_engine_id: str
    local_tp_rank: int
    state: str
    state_for_s: float
    tries: int
    last_error: str
    paired_ranks: int
    def __init__(self, address: _Optional[str] = ..., engine_id: _Optional[str] = ..., local_engine_id: _Optional[str] = ..., local_tp_rank: _Optional[int] = ..., state: _Optional[str] = ..., state_for_s: _Optional[float] = ..., tries: _Optional[int] = ..., last_error: _Optional[str] = ..., paired_ranks: _Optional[int] = ...) -> None: ...

class LeaseRenewal(_message.Message):
    __slots__ = ("request_id", "groups")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, request_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class LeaseRenewed(_message.Message):
    __slots__ = ("request_id", "left_s", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEFT_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    left_s: float
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., left_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("remote_engine_id", "remote_address", "renewals")
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_FIELD_NUMBER: _ClassVar[int]
    remote_engine_id: str
    remote_address: str
    renewals: _containers.RepeatedCompositeFieldContainer[LeaseRenewal]
    def __init__(self, remote_engine_id: _Optional[str] = ..., remote_address: _Optional[str] = ..., renewals: _Optional[_Iterable[_Union[LeaseRenewal, _Mapping]]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LeaseRenewed]
    def __init__(self, results: _Optional[_Iterable[_Union[LeaseRenewed, _Mapping]]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "daemon_version", "compat_hash", "protocol_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    daemon_version: str
    compat_hash: str
    protocol_version: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., daemon_version: _Optional[str] = ..., compat_hash: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("agent_metadata", "agent_name", "layout", "regions", "region_base_addrs", "compat_hash", "daemon_version", "protocol_version", "tp_size", "memory", "device", "warm_up_addr", "holds_epoch", "read_transport")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    REGION_BASE_ADDRS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WARM_UP_ADDR_FIELD_NUMBER: _ClassVar[int]
    HOLDS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    READ_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    agent_name: str
    layout: Layout
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    region_base_addrs: _containers.RepeatedScalarFieldContainer[int]
    compat_hash: str
    daemon_version: str
    protocol_version: int
    tp_size: int
    memory: str
    device: int
    warm_up_addr: int
    holds_epoch: str
    read_transport: str
    def __init__(self, agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., region_base_addrs: _Optional[_Iterable[int]] = ..., compat_hash: _Optional[str] = ..., daemon_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., tp_size: _Optional[int] = ..., memory: _Optional[str] = ..., device: _Optional[int] = ..., warm_up_addr: _Optional[int] = ..., holds_epoch: _Optional[str] = ..., read_transport: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "request_id", "reader", "reader_tp_rank", "expected_notifications", "timeout_s", "source_groups", "reader_groups")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    READER_FIELD_NUMBER: _ClassVar[int]
    READER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    READER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    request_id: str
    reader: HandshakeResponse
    reader_tp_rank: int
    expected_notifications: int
    timeout_s: float
    source_groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    reader_groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., request_id: _Optional[str] = ..., reader: _Optional[_Union[HandshakeResponse, _Mapping]] = ..., reader_tp_rank: _Optional[int] = ..., expected_notifications: _Optional[int] = ..., timeout_s: _Optional[float] = ..., source_groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., reader_groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("bytes", "num_descriptors", "duration_s")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    num_descriptors: int
    duration_s: float
    def __init__(self, bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class NotifyRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "request_id", "expected_notifications")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    request_id: str
    expected_notifications: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., request_id: _Optional[str] = ..., expected_notifications: _Optional[int] = ...) -> None: ...

class NotifyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "request_id", "groups", "wait_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    request_id: str
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    wait_s: float
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., request_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldsRequest(_message.Message):
    __slots__ = ("engine_id", "epoch", "after", "wait_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: str
    after: int
    wait_s: float
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[str] = ..., after: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class HoldChange(_message.Message):
    __slots__ = ("tp_rank", "request_id", "groups", "ended")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    request_id: str
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    ended: bool
    def __init__(self, tp_rank: _Optional[int] = ..., request_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., ended: _Optional[bool] = ...) -> None: ...

class HoldsResponse(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "changes", "snapshot")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    reset: bool
    changes: _containers.RepeatedCompositeFieldContainer[HoldChange]
    snapshot: bool
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., changes: _Optional[_Iterable[_Union[HoldChange, _Mapping]]] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("engine_id", "renewals")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    renewals: _containers.RepeatedCompositeFieldContainer[LeaseRenewal]
    def __init__(self, engine_id: _Optional[str] = ..., renewals: _Optional[_Iterable[_Union[LeaseRenewal, _Mapping]]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LeaseRenewed]
    def __init__(self, results: _Optional[_Iterable[_Union[LeaseRenewed, _Mapping]]] = ...) -> None: ...
