from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
PROPOSAL_KIND_UNSPECIFIED: ProposalKind
DENSE: ProposalKind
SPARSE_TOP_N: ProposalKind
IDS_ONLY: ProposalKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("model", "vocab_size", "eos_token_ids", "max_context", "tokenizer_fingerprint", "dtype", "device", "max_draft_tokens", "tokenizer_source", "role")
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
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., tokenizer_source: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "truncate_to", "append_token_ids", "num_draft_tokens", "sampling", "proposal_format")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    truncate_to: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    sampling: SamplingParams
    proposal_format: ProposalFormat
    def __init__(self, session_id: _Optional[str] = ..., truncate_to: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., proposal_format: _Optional[_Union[ProposalFormat, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_token_ids", "proposal", "kv_length")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    KV_LENGTH_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposal: Proposal
    kv_length: int
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., kv_length: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "truncate_to", "append_token_ids", "draft_token_ids", "proposal", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    truncate_to: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposal: Proposal
    sampling: SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., truncate_to: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("output_token_ids", "num_accepted", "kv_length")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    KV_LENGTH_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    kv_length: int
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., kv_length: _Optional[int] = ...) -> None: ...
