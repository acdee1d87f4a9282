from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_REQUEST: _ClassVar[ErrorCode]
    ERROR_CODE_OVERLOADED: _ClassVar[ErrorCode]
    ERROR_CODE_SHUTTING_DOWN: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_REQUEST: ErrorCode
ERROR_CODE_OVERLOADED: ErrorCode
ERROR_CODE_SHUTTING_DOWN: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids", "ignore_eos", "logprobs", "seed", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    prompt_logprobs: int
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "source", "compact")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    compact: bool
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ..., compact: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("accepted", "code", "message", "instance_id", "param")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    code: ErrorCode
    message: str
    instance_id: str
    param: str
    def __init__(self, accepted: _Optional[bool] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., instance_id: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "decode_instance", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    decode_instance: str
    images: _containers.RepeatedCompositeFieldContainer[ImageData]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., decode_instance: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageData, _Mapping]]] = ...) -> None: ...

class ImageData(_message.Message):
    __slots__ = ("png", "height", "width", "hash", "embedded", "peer_source")
    PNG_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDED_FIELD_NUMBER: _ClassVar[int]
    PEER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    png: bytes
    height: int
    width: int
    hash: bytes
    embedded: bool
    peer_source: bytes
    def __init__(self, png: _Optional[bytes] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., hash: _Optional[bytes] = ..., embedded: _Optional[bool] = ..., peer_source: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImageData]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageData, _Mapping]]] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("ok", "error", "num_encoded", "num_cache_hits", "num_kvcache_hits", "instance_id", "code_param", "peer_sources")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_KVCACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_PARAM_FIELD_NUMBER: _ClassVar[int]
    PEER_SOURCES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    num_encoded: int
    num_cache_hits: int
    num_kvcache_hits: int
    instance_id: str
    code_param: str
    peer_sources: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., num_encoded: _Optional[int] = ..., num_cache_hits: _Optional[int] = ..., num_kvcache_hits: _Optional[int] = ..., instance_id: _Optional[str] = ..., code_param: _Optional[str] = ..., peer_sources: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class DecodeHandoff(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "cache_salt", "block_hashes", "num_cached_tokens", "first_logprobs", "prefill_instance", "kv_source", "prompt_logprobs", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_cached_tokens: int
    first_logprobs: TokenLogprobs
    prefill_instance: str
    kv_source: KvSource
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    images: _containers.RepeatedCompositeFieldContainer[ImageData]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_cached_tokens: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prefill_instance: _Optional[str] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[ImageData, _Mapping]]] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("instance_id", "region", "block_ids", "num_blocks", "lease_deadline_unix", "layout", "window_first", "window_block_ids", "nixl")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIRST_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    region: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    lease_deadline_unix: float
    layout: str
    window_first: int
    window_block_ids: _containers.RepeatedScalarFieldContainer[int]
    nixl: bytes
    def __init__(self, instance_id: _Optional[str] = ..., region: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ..., lease_deadline_unix: _Optional[float] = ..., layout: _Optional[str] = ..., window_first: _Optional[int] = ..., window_block_ids: _Optional[_Iterable[int]] = ..., nixl: _Optional[bytes] = ...) -> None: ...

class NixlMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NixlMetadata(_message.Message):
    __slots__ = ("agent", "metadata")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    agent: str
    metadata: bytes
    def __init__(self, agent: _Optional[str] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class ResetPrefixCache(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefixCacheReset(_message.Message):
    __slots__ = ("instance_id", "num_device_blocks", "num_host_blocks", "num_unflushed")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNFLUSHED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_device_blocks: int
    num_host_blocks: int
    num_unflushed: int
    def __init__(self, instance_id: _Optional[str] = ..., num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_unflushed: _Optional[int] = ...) -> None: ...

class KvRelease(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "spec_drafted_tokens", "spec_accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    spec_drafted_tokens: int
    spec_accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., spec_drafted_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "seq", "token_ids", "logprobs", "final", "finish_reason", "usage", "error_code", "error", "instance_id", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    final: bool
    finish_reason: str
    usage: Usage
    error_code: ErrorCode
    error: str
    instance_id: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., final: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error_code: _Optional[_Union[ErrorCode, str]] = ..., error: _Optional[str] = ..., instance_id: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_kv_blocks", "num_total_kv_blocks", "num_queued_tokens", "expert_load")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_queued_tokens: int
    expert_load: ExpertLoad
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_total_kv_blocks: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., expert_load: _Optional[_Union[ExpertLoad, _Mapping]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("num_ranks", "window_steps", "layers", "num_rebalances", "num_redundant_experts")
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_REBALANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_REDUNDANT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    num_ranks: int
    window_steps: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerExpertLoad]
    num_rebalances: int
    num_redundant_experts: int
    def __init__(self, num_ranks: _Optional[int] = ..., window_steps: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerExpertLoad, _Mapping]]] = ..., num_rebalances: _Optional[int] = ..., num_redundant_experts: _Optional[int] = ...) -> None: ...

class LayerExpertLoad(_message.Message):
    __slots__ = ("mean_tokens_per_rank", "max_tokens_per_rank", "balancedness")
    MEAN_TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    mean_tokens_per_rank: float
    max_tokens_per_rank: int
    balancedness: float
    def __init__(self, mean_tokens_per_rank: _Optional[float] = ..., max_tokens_per_rank: _Optional[int] = ..., balancedness: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("stage", "instance_id", "seq", "unix_time", "load", "model", "interval_s", "draining", "image_hashes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    IMAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    stage: str
    instance_id: str
    seq: int
    unix_time: float
    load: Load
    model: str
    interval_s: float
    draining: bool
    image_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, stage: _Optional[str] = ..., instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., unix_time: _Optional[float] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., model: _Optional[str] = ..., interval_s: _Optional[float] = ..., draining: _Optional[bool] = ..., image_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("instance_id", "seq", "stored", "removed", "cleared")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    seq: int
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    cleared: bool
    def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., cleared: _Optional[bool] = ...) -> None: ...
