from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frame(_message.Message):
    __slots__ = ("dtype", "start", "rows", "width", "data", "scales")
    class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        F32: _ClassVar[Frame.DType]
        F16: _ClassVar[Frame.DType]
        Q8: _ClassVar[Frame.DType]
    F32: Frame.DType
    F16: Frame.DType
    Q8: Frame.DType
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: Frame.DType
    start: int
    rows: int
    width: int
    data: bytes
    scales: bytes
    def __init__(self, dtype: _Optional[_Union[Frame.DType, str]] = ..., start: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "generated", "logprobs", "logits", "constraint", "propose")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    generated: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    logits: bool
    constraint: Constraint
    propose: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., generated: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., logits: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., propose: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("tokens", "limit", "probe", "namespace", "sampling", "results", "peers", "prefill")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    limit: int
    probe: bool
    namespace: str
    sampling: Sampling
    results: bool
    peers: _containers.RepeatedScalarFieldContainer[str]
    prefill: bool
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., limit: _Optional[int] = ..., probe: _Optional[bool] = ..., namespace: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., results: _Optional[bool] = ..., peers: _Optional[_Iterable[str]] = ..., prefill: _Optional[bool] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("start", "verify", "propose")
    START_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    start: int
    verify: bool
    propose: bool
    def __init__(self, start: _Optional[int] = ..., verify: _Optional[bool] = ..., propose: _Optional[bool] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("tokens", "start", "frame", "sampling", "probe", "namespace", "max_tokens", "replay", "embed")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    start: int
    frame: Frame
    sampling: Sampling
    probe: bool
    namespace: str
    max_tokens: int
    replay: bool
    embed: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., frame: _Optional[_Union[Frame, _Mapping]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., probe: _Optional[bool] = ..., namespace: _Optional[str] = ..., max_tokens: _Optional[int] = ..., replay: _Optional[bool] = ..., embed: _Optional[str] = ...) -> None: ...

class Decode(_message.Message):
    __slots__ = ("token", "frame", "replay", "proposed", "length", "reply_to", "propose", "step", "cohort")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COHORT_FIELD_NUMBER: _ClassVar[int]
    token: int
    frame: Frame
    replay: bool
    proposed: _containers.RepeatedScalarFieldContainer[int]
    length: int
    reply_to: str
    propose: int
    step: int
    cohort: int
    def __init__(self, token: _Optional[int] = ..., frame: _Optional[_Union[Frame, _Mapping]] = ..., replay: _Optional[bool] = ..., proposed: _Optional[_Iterable[int]] = ..., length: _Optional[int] = ..., reply_to: _Optional[str] = ..., propose: _Optional[int] = ..., step: _Optional[int] = ..., cohort: _Optional[int] = ...) -> None: ...

class ReplyTo(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class StageCall(_message.Message):
    __slots__ = ("plan", "prefill", "decode", "traceparent", "last")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    prefill: Prefill
    decode: Decode
    traceparent: str
    last: bool
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., prefill: _Optional[_Union[Prefill, _Mapping]] = ..., decode: _Optional[_Union[Decode, _Mapping]] = ..., traceparent: _Optional[str] = ..., last: _Optional[bool] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "cached_tokens", "logprob", "top", "logits", "more", "plan", "proposals")
    ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    id: int
    cached_tokens: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[Alternative]
    logits: bytes
    more: _containers.RepeatedCompositeFieldContainer[Token]
    plan: PlanReply
    proposals: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[Alternative, _Mapping]]] = ..., logits: _Optional[bytes] = ..., more: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., plan: _Optional[_Union[PlanReply, _Mapping]] = ..., proposals: _Optional[_Iterable[int]] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class Alternative(_message.Message):
    __slots__ = ("id", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("message", "retryable", "busy", "invalid", "param", "error_id")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    ERROR_ID_FIELD_NUMBER: _ClassVar[int]
    message: str
    retryable: bool
    busy: bool
    invalid: bool
    param: str
    error_id: str
    def __init__(self, message: _Optional[str] = ..., retryable: _Optional[bool] = ..., busy: _Optional[bool] = ..., invalid: _Optional[bool] = ..., param: _Optional[str] = ..., error_id: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    def __init__(self, values: _Optional[bytes] = ...) -> None: ...

class StageResult(_message.Message):
    __slots__ = ("plan", "token", "error", "done", "embedding")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    plan: PlanReply
    token: Token
    error: Error
    done: Done
    embedding: Embedding
    def __init__(self, plan: _Optional[_Union[PlanReply, _Mapping]] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ...) -> None: ...

class BlockRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("hash", "data")
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    data: bytes
    def __init__(self, hash: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("tokens", "limit", "after", "namespace")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    limit: int
    after: int
    namespace: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., limit: _Optional[int] = ..., after: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class ExportReply(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: bytes
    def __init__(self, manifest: _Optional[bytes] = ...) -> None: ...
