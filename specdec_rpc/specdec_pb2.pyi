from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcceptanceMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCEPTANCE_METHOD_UNSPECIFIED: _ClassVar[AcceptanceMethod]
    REJECTION_SAMPLER: _ClassVar[AcceptanceMethod]
    GREEDY: _ClassVar[AcceptanceMethod]
    TYPICAL_ACCEPTANCE_SAMPLER: _ClassVar[AcceptanceMethod]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class ProposalKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSAL_KIND_UNSPECIFIED: _ClassVar[ProposalKind]
    DENSE: _ClassVar[ProposalKind]
    SPARSE_TOP_N: _ClassVar[ProposalKind]
    IDS_ONLY: _ClassVar[ProposalKind]
ACCEPTANCE_METHOD_UNSPECIFIED: AcceptanceMethod
REJECTION_SAMPLER: AcceptanceMethod
GREEDY: AcceptanceMethod
TYPICAL_ACCEPTANCE_SAMPLER: AcceptanceMethod
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
PROPOSAL_KIND_UNSPECIFIED: ProposalKind
DENSE: ProposalKind
SPARSE_TOP_N: ProposalKind
IDS_ONLY: ProposalKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "acceptance_method", "posterior_threshold", "posterior_alpha", "logit_bias", "allowed_token_ids", "prompt_logprobs")
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
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_METHOD_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    acceptance_method: AcceptanceMethod
    posterior_threshold: float
    posterior_alpha: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., acceptance_method: _Optional[_Union[AcceptanceMethod, str]] = ..., posterior_threshold: _Optional[float] = ..., posterior_alpha: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class ProposalFormat(_message.Message):
    __slots__ = ("kind", "dtype", "top_n")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    kind: ProposalKind
    dtype: DType
    top_n: int
    def __init__(self, kind: _Optional[_Union[ProposalKind, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., top_n: _Optional[int] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("kind", "dtype", "shape", "probs", "token_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: ProposalKind
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    probs: bytes
    token_ids: bytes
    def __init__(self, kind: _Optional[_Union[ProposalKind, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., probs: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "max_context", "tokenizer_fingerprint", "dtype", "device", "max_draft_tokens", "tokenizer_source", "role", "max_sessions", "instance_id", "device_uuid")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    tokenizer_fingerprint: str
    dtype: str
    device: str
    max_draft_tokens: int
    tokenizer_source: str
    role: str
    max_sessions: int
    instance_id: str
    device_uuid: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., tokenizer_source: _Optional[str] = ..., role: _Optional[str] = ..., max_sessions: _Optional[int] = ..., instance_id: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "instance_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    instance_id: str
    def __init__(self, session_id: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "truncate_to", "append_token_ids", "num_draft_tokens", "sampling", "proposal_format", "prompt_length", "fanout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    truncate_to: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    sampling: SamplingParams
    proposal_format: ProposalFormat
    prompt_length: int
    fanout: int
    def __init__(self, session_id: _Optional[str] = ..., truncate_to: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., proposal_format: _Optional[_Union[ProposalFormat, _Mapping]] = ..., prompt_length: _Optional[int] = ..., fanout: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_token_ids", "proposal", "kv_length", "cached_draft_tokens", "load")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    KV_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposal: Proposal
    kv_length: int
    cached_draft_tokens: int
    load: EngineLoad
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., kv_length: _Optional[int] = ..., cached_draft_tokens: _Optional[int] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running_sessions", "step_rows", "step_tokens", "step_ms", "queue_ms", "speculation_disabled", "device_ms", "host_ms")
    RUNNING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_DISABLED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_MS_FIELD_NUMBER: _ClassVar[int]
    running_sessions: int
    step_rows: int
    step_tokens: int
    step_ms: float
    queue_ms: float
    speculation_disabled: bool
    device_ms: float
    host_ms: float
    def __init__(self, running_sessions: _Optional[int] = ..., step_rows: _Optional[int] = ..., step_tokens: _Optional[int] = ..., step_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., speculation_disabled: _Optional[bool] = ..., device_ms: _Optional[float] = ..., host_ms: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "truncate_to", "append_token_ids", "draft_token_ids", "proposal", "sampling", "prompt_length", "decode_steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    truncate_to: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposal: Proposal
    sampling: SamplingParams
    prompt_length: int
    decode_steps: int
    def __init__(self, session_id: _Optional[str] = ..., truncate_to: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_length: _Optional[int] = ..., decode_steps: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "rank", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("output_token_ids", "num_accepted", "kv_length", "logprobs", "load", "prompt_logprobs")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    KV_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    kv_length: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    load: EngineLoad
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., kv_length: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("requests", "tag")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    tag: int
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ..., tag: _Optional[int] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("code", "message", "response")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    response: VerifyResponse
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("results", "tag")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    tag: int
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., tag: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("role", "requests", "failed_requests", "forwards", "draft_tokens", "accepted_tokens", "emitted_tokens", "live_sessions", "kv_tokens", "kv_bytes", "batches", "evictions", "speculation_hits", "speculation_partial_hits", "speculation_misses", "speculation_draft_tokens", "speculation_dropped_branches", "cancelled_requests", "batched_rows")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_HITS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_PARTIAL_HITS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MISSES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_DROPPED_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ROWS_FIELD_NUMBER: _ClassVar[int]
    role: str
    requests: int
    failed_requests: int
    forwards: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    live_sessions: int
    kv_tokens: int
    kv_bytes: int
    batches: int
    evictions: int
    speculation_hits: int
    speculation_partial_hits: int
    speculation_misses: int
    speculation_draft_tokens: int
    speculation_dropped_branches: int
    cancelled_requests: int
    batched_rows: int
    def __init__(self, role: _Optional[str] = ..., requests: _Optional[int] = ..., failed_requests: _Optional[int] = ..., forwards: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., emitted_tokens: _Optional[int] = ..., live_sessions: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., batches: _Optional[int] = ..., evictions: _Optional[int] = ..., speculation_hits: _Optional[int] = ..., speculation_partial_hits: _Optional[int] = ..., speculation_misses: _Optional[int] = ..., speculation_draft_tokens: _Optional[int] = ..., speculation_dropped_branches: _Optional[int] = ..., cancelled_requests: _Optional[int] = ..., batched_rows: _Optional[int] = ...) -> None: ...
