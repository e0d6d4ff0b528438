from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]
    ROLE_MODEL_DEVELOPER: _ClassVar[Role]
    ROLE_APP_DEVELOPER: _ClassVar[Role]
    ROLE_APP_USER: _ClassVar[Role]
    ROLE_SERVICE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_ADMIN: Role
ROLE_MODEL_DEVELOPER: Role
ROLE_APP_DEVELOPER: Role
ROLE_APP_USER: Role
ROLE_SERVICE: Role

class TokenInfo(_message.Message):
    __slots__ = ("token_id", "subject", "role", "deployments", "created_at_unix_ms")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    subject: str
    role: Role
    deployments: _containers.RepeatedScalarFieldContainer[str]
    created_at_unix_ms: int
    def __init__(self, token_id: _Optional[str] = ..., subject: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., deployments: _Optional[_Iterable[str]] = ..., created_at_unix_ms: _Optional[int] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("request_id", "subject", "role", "deployments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    subject: str
    role: Role
    deployments: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., subject: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., deployments: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateTokenResponse(_message.Message):
    __slots__ = ("request_id", "token", "secret")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: TokenInfo
    secret: str
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[TokenInfo, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class ListTokensRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ListTokensResponse(_message.Message):
    __slots__ = ("request_id", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInfo]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[TokenInfo, _Mapping]]] = ...) -> None: ...

class RevokeTokenRequest(_message.Message):
    __slots__ = ("request_id", "token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: str
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[str] = ...) -> None: ...

class RevokeTokenResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...
