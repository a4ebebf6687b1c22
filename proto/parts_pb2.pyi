from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PartRequest(_message.Message):
    __slots__ = ("model_digest", "file", "first_block")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    file: str
    first_block: int
    def __init__(self, model_digest: _Optional[str] = ..., file: _Optional[str] = ..., first_block: _Optional[int] = ...) -> None: ...

class PartBlock(_message.Message):
    __slots__ = ("index", "data", "blake3")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    blake3: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., blake3: _Optional[bytes] = ...) -> None: ...
