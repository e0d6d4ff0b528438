"""Encoding of records stored in Redis: protobuf messages as JSON, so that people can
read them with redis-cli, with field names as in the .proto files."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


def encode(message: Message) -> str:
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)


def decode(cls: type[M], raw: str | bytes) -> M:
    return json_format.Parse(raw, cls(), ignore_unknown_fields=True)
