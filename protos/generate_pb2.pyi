from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrammarType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_TYPE_UNSPECIFIED: _ClassVar[GrammarType]
    GRAMMAR_TYPE_JSON_SCHEMA: _ClassVar[GrammarType]
    GRAMMAR_TYPE_JSON_OBJECT: _ClassVar[GrammarType]
    GRAMMAR_TYPE_REGEX: _ClassVar[GrammarType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]

class PrefillCase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NORMAL: _ClassVar[PrefillCase]
    MIGRATE: _ClassVar[PrefillCase]
    MIGRATE_PROGRESSIVE: _ClassVar[PrefillCase]
    NAIVE_PP: _ClassVar[PrefillCase]
    IMMIGRATE: _ClassVar[PrefillCase]

class PartialCase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARTIAL_CASE_UNSPECIFIED: _ClassVar[PartialCase]
    PARTIAL_CASE_FIRST: _ClassVar[PartialCase]
    PARTIAL_CASE_SECOND: _ClassVar[PartialCase]

class LoadParamCase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOAD_FROM_HOST_MEM: _ClassVar[LoadParamCase]
    LOAD_FROM_DISK: _ClassVar[LoadParamCase]
GRAMMAR_TYPE_UNSPECIFIED: GrammarType
GRAMMAR_TYPE_JSON_SCHEMA: GrammarType
GRAMMAR_TYPE_JSON_OBJECT: GrammarType
GRAMMAR_TYPE_REGEX: GrammarType
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
NORMAL: PrefillCase
MIGRATE: PrefillCase
MIGRATE_PROGRESSIVE: PrefillCase
NAIVE_PP: PrefillCase
IMMIGRATE: PrefillCase
PARTIAL_CASE_UNSPECIFIED: PartialCase
PARTIAL_CASE_FIRST: PartialCase
PARTIAL_CASE_SECOND: PartialCase
LOAD_FROM_HOST_MEM: LoadParamCase
LOAD_FROM_DISK: LoadParamCase

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("requires_padding", "dtype", "device_type", "window_size", "speculate", "model_id", "num_layers", "block_size", "num_blocks_total", "num_blocks_free", "embed_ready", "num_layers_loaded", "lm_head_ready", "rank", "tp_size", "num_cached_batches", "max_input_tokens", "max_total_tokens", "device", "gpu_name", "attention_backend", "cuda_graphs", "prefix_cache", "num_blocks_cached", "cached_page_hashes", "fabric", "weights_model", "host_copies", "instance")
    REQUIRES_PADDING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    EMBED_READY_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    LM_HEAD_READY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    FABRIC_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_MODEL_FIELD_NUMBER: _ClassVar[int]
    HOST_COPIES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    requires_padding: bool
    dtype: str
    device_type: str
    window_size: int
    speculate: int
    model_id: str
    num_layers: int
    block_size: int
    num_blocks_total: int
    num_blocks_free: int
    embed_ready: bool
    num_layers_loaded: int
    lm_head_ready: bool
    rank: int
    tp_size: int
    num_cached_batches: int
    max_input_tokens: int
    max_total_tokens: int
    device: str
    gpu_name: str
    attention_backend: str
    cuda_graphs: bool
    prefix_cache: bool
    num_blocks_cached: int
    cached_page_hashes: _containers.RepeatedScalarFieldContainer[int]
    fabric: str
    weights_model: str
    host_copies: _containers.RepeatedCompositeFieldContainer[HostCopy]
    instance: str
    def __init__(self, requires_padding: _Optional[bool] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., window_size: _Optional[int] = ..., speculate: _Optional[int] = ..., model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., embed_ready: _Optional[bool] = ..., num_layers_loaded: _Optional[int] = ..., lm_head_ready: _Optional[bool] = ..., rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_cached_batches: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., device: _Optional[str] = ..., gpu_name: _Optional[str] = ..., attention_backend: _Optional[str] = ..., cuda_graphs: _Optional[bool] = ..., prefix_cache: _Optional[bool] = ..., num_blocks_cached: _Optional[int] = ..., cached_page_hashes: _Optional[_Iterable[int]] = ..., fabric: _Optional[str] = ..., weights_model: _Optional[str] = ..., host_copies: _Optional[_Iterable[_Union[HostCopy, _Mapping]]] = ..., instance: _Optional[str] = ...) -> None: ...

class HostCopy(_message.Message):
    __slots__ = ("model", "bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    bytes: int
    def __init__(self, model: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class ServiceDiscoveryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryResponse(_message.Message):
    __slots__ = ("urls", "ranks_view_in_json")
    URLS_FIELD_NUMBER: _ClassVar[int]
    RANKS_VIEW_IN_JSON_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.RepeatedScalarFieldContainer[str]
    ranks_view_in_json: str
    def __init__(self, urls: _Optional[_Iterable[str]] = ..., ranks_view_in_json: _Optional[str] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NextTokenChooserParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "watermark", "frequency_penalty", "presence_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    watermark: bool
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., watermark: _Optional[bool] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StoppingCriteriaParameters(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos_token", "min_new_tokens")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos_token: bool
    min_new_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos_token: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "inputs", "truncate", "parameters", "stopping_parameters", "prefill_logprobs", "top_n_tokens", "input_tokens", "generated_prefix", "grammar")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    id: int
    inputs: str
    truncate: int
    parameters: NextTokenChooserParameters
    stopping_parameters: StoppingCriteriaParameters
    prefill_logprobs: bool
    top_n_tokens: int
    input_tokens: _containers.RepeatedScalarFieldContainer[int]
    generated_prefix: int
    grammar: Grammar
    def __init__(self, id: _Optional[int] = ..., inputs: _Optional[str] = ..., truncate: _Optional[int] = ..., parameters: _Optional[_Union[NextTokenChooserParameters, _Mapping]] = ..., stopping_parameters: _Optional[_Union[StoppingCriteriaParameters, _Mapping]] = ..., prefill_logprobs: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., input_tokens: _Optional[_Iterable[int]] = ..., generated_prefix: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("type", "text")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    type: GrammarType
    text: str
    def __init__(self, type: _Optional[_Union[GrammarType, str]] = ..., text: _Optional[str] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "requests", "size", "max_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    size: int
    max_tokens: int
    def __init__(self, id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ..., size: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class CachedBatch(_message.Message):
    __slots__ = ("id", "request_ids", "size", "max_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    size: int
    max_tokens: int
    def __init__(self, id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ..., size: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class GeneratedText(_message.Message):
    __slots__ = ("text", "generated_tokens", "finish_reason", "seed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int
    def __init__(self, text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "logprobs", "texts", "is_special")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., is_special: _Optional[_Iterable[bool]] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "prefill_tokens", "tokens", "generated_text", "top_tokens", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prefill_tokens: Tokens
    tokens: Tokens
    generated_text: GeneratedText
    top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    cached_tokens: int
    def __init__(self, request_id: _Optional[int] = ..., prefill_tokens: _Optional[_Union[Tokens, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., generated_text: _Optional[_Union[GeneratedText, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class FilterBatchRequest(_message.Message):
    __slots__ = ("batch_id", "request_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FilterBatchResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: CachedBatch
    def __init__(self, batch: _Optional[_Union[CachedBatch, _Mapping]] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("batch", "max_input_length", "max_prefill_tokens", "max_total_tokens")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    max_input_length: int
    max_prefill_tokens: int
    max_total_tokens: int
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., max_input_length: _Optional[int] = ..., max_prefill_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("max_supported_total_tokens",)
    MAX_SUPPORTED_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_supported_total_tokens: int
    def __init__(self, max_supported_total_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "decode_ns", "total_ns")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    forward_ns: int
    decode_ns: int
    total_ns: int
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[CachedBatch]
    def __init__(self, batches: _Optional[_Iterable[_Union[CachedBatch, _Mapping]]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "decode_ns", "total_ns", "concat_ns")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    CONCAT_NS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    forward_ns: int
    decode_ns: int
    total_ns: int
    concat_ns: int
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., concat_ns: _Optional[int] = ...) -> None: ...

class PipeParaInfo(_message.Message):
    __slots__ = ("embedding_layer", "lm_head", "tfm_layer", "num_layer_per_rank")
    EMBEDDING_LAYER_FIELD_NUMBER: _ClassVar[int]
    LM_HEAD_FIELD_NUMBER: _ClassVar[int]
    TFM_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYER_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    embedding_layer: int
    lm_head: int
    tfm_layer: int
    num_layer_per_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, embedding_layer: _Optional[int] = ..., lm_head: _Optional[int] = ..., tfm_layer: _Optional[int] = ..., num_layer_per_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillV2Request(_message.Message):
    __slots__ = ("batch", "forward_case", "pp_info", "pipe_peer", "chunk_tokens")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CASE_FIELD_NUMBER: _ClassVar[int]
    PP_INFO_FIELD_NUMBER: _ClassVar[int]
    PIPE_PEER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    forward_case: int
    pp_info: PipeParaInfo
    pipe_peer: _containers.RepeatedScalarFieldContainer[int]
    chunk_tokens: int
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., forward_case: _Optional[int] = ..., pp_info: _Optional[_Union[PipeParaInfo, _Mapping]] = ..., pipe_peer: _Optional[_Iterable[int]] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class PrefillChunkRequest(_message.Message):
    __slots__ = ("batch_id", "chunk_tokens")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    chunk_tokens: int
    def __init__(self, batch_id: _Optional[int] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class PrefillV2Response(_message.Message):
    __slots__ = ("generations", "batch", "pp_info", "forward_ns", "decode_ns", "total_ns", "evicted_page_hashes")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PP_INFO_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    pp_info: PipeParaInfo
    forward_ns: int
    decode_ns: int
    total_ns: int
    evicted_page_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., pp_info: _Optional[_Union[PipeParaInfo, _Mapping]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., evicted_page_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeV2Request(_message.Message):
    __slots__ = ("batches", "last_iter_tokens")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_ITER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[CachedBatch]
    last_iter_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    def __init__(self, batches: _Optional[_Iterable[_Union[CachedBatch, _Mapping]]] = ..., last_iter_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ...) -> None: ...

class DecodeV2Response(_message.Message):
    __slots__ = ("generations", "batch", "total_ns", "evicted_page_hashes")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    total_ns: int
    evicted_page_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., total_ns: _Optional[int] = ..., evicted_page_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class ZagPrefillRequest(_message.Message):
    __slots__ = ("batch", "forward_case", "pp_info", "zag_layers", "zag_seq_num")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CASE_FIELD_NUMBER: _ClassVar[int]
    PP_INFO_FIELD_NUMBER: _ClassVar[int]
    ZAG_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ZAG_SEQ_NUM_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    forward_case: int
    pp_info: PipeParaInfo
    zag_layers: int
    zag_seq_num: int
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., forward_case: _Optional[int] = ..., pp_info: _Optional[_Union[PipeParaInfo, _Mapping]] = ..., zag_layers: _Optional[int] = ..., zag_seq_num: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("batch", "src", "dst")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: CachedBatch
    def __init__(self, batch: _Optional[_Union[CachedBatch, _Mapping]] = ...) -> None: ...

class ImmigrateRequest(_message.Message):
    __slots__ = ("batch", "src", "dst")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class ImmigrateResponse(_message.Message):
    __slots__ = ("batch", "reused_tokens", "evicted_page_hashes", "request_reused_tokens")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch: CachedBatch
    reused_tokens: int
    evicted_page_hashes: _containers.RepeatedScalarFieldContainer[int]
    request_reused_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., reused_tokens: _Optional[int] = ..., evicted_page_hashes: _Optional[_Iterable[int]] = ..., request_reused_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class MigratePartialRequest(_message.Message):
    __slots__ = ("batch", "fst_or_snd", "num_layer", "src", "dst")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FST_OR_SND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYER_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    fst_or_snd: PartialCase
    num_layer: int
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., fst_or_snd: _Optional[_Union[PartialCase, str]] = ..., num_layer: _Optional[int] = ..., src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class ImmigratePartialRequest(_message.Message):
    __slots__ = ("batch", "fst_or_snd", "num_layer", "src", "dst")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FST_OR_SND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYER_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    fst_or_snd: PartialCase
    num_layer: int
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., fst_or_snd: _Optional[_Union[PartialCase, str]] = ..., num_layer: _Optional[int] = ..., src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("src_ranks", "dst_ranks", "model_name")
    SRC_RANKS_FIELD_NUMBER: _ClassVar[int]
    DST_RANKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    src_ranks: _containers.RepeatedScalarFieldContainer[int]
    dst_ranks: _containers.RepeatedScalarFieldContainer[int]
    model_name: str
    def __init__(self, src_ranks: _Optional[_Iterable[int]] = ..., dst_ranks: _Optional[_Iterable[int]] = ..., model_name: _Optional[str] = ...) -> None: ...

class BroadcastResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SendParamsRequest(_message.Message):
    __slots__ = ("dst", "model_name", "host_copy_model", "share", "shares")
    DST_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_COPY_MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    dst: int
    model_name: str
    host_copy_model: str
    share: int
    shares: int
    def __init__(self, dst: _Optional[int] = ..., model_name: _Optional[str] = ..., host_copy_model: _Optional[str] = ..., share: _Optional[int] = ..., shares: _Optional[int] = ...) -> None: ...

class SendParamsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RecvParamsRequest(_message.Message):
    __slots__ = ("src", "model_name", "more_srcs")
    SRC_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MORE_SRCS_FIELD_NUMBER: _ClassVar[int]
    src: int
    model_name: str
    more_srcs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[int] = ..., model_name: _Optional[str] = ..., more_srcs: _Optional[_Iterable[int]] = ...) -> None: ...

class RecvParamsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadParamsRequest(_message.Message):
    __slots__ = ("load_case", "model_name", "model_path")
    LOAD_CASE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    load_case: LoadParamCase
    model_name: str
    model_path: str
    def __init__(self, load_case: _Optional[_Union[LoadParamCase, str]] = ..., model_name: _Optional[str] = ..., model_path: _Optional[str] = ...) -> None: ...

class LoadParamsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayRequest(_message.Message):
    __slots__ = ("rank", "relax_not_head")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RELAX_NOT_HEAD_FIELD_NUMBER: _ClassVar[int]
    rank: int
    relax_not_head: bool
    def __init__(self, rank: _Optional[int] = ..., relax_not_head: _Optional[bool] = ...) -> None: ...

class RelayResponse(_message.Message):
    __slots__ = ("batch_id", "seq_num")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_NUM_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    seq_num: int
    def __init__(self, batch_id: _Optional[int] = ..., seq_num: _Optional[int] = ...) -> None: ...

class ResetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetStatusResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetStatusReadyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetStatusReadyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitRdmaDoneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitRdmaDoneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConnectPeersRequest(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, peers: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerLink(_message.Message):
    __slots__ = ("rank", "error", "connect_ms")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONNECT_MS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    error: str
    connect_ms: float
    def __init__(self, rank: _Optional[int] = ..., error: _Optional[str] = ..., connect_ms: _Optional[float] = ...) -> None: ...

class ConnectPeersResponse(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[PeerLink]
    def __init__(self, links: _Optional[_Iterable[_Union[PeerLink, _Mapping]]] = ...) -> None: ...
