"""Encoding of records stored in Redis: protobuf messages as JSON, so that people can
read them with redis-cli, with field names as in the .proto files.

The one exception is a record that runs to thousands of rows and is read on a hot path
(a model's profile, read by every estimate): protobuf's JSON parser walks each field in
Python (0.56 s for 5,000 measurements, 16 s for 200,000 on one core of a 2-core dev box, against
2 and 120 ms from the binary form), so :func:`encode_compact` stores the binary form,
base64 under a ``pb64:`` marker (the store's connection reads text). :func:`decode`
reads both forms, so a record stored as JSON by an earlier version still reads.
"""

from __future__ import annotations

import base64
from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


def encode(message: Message) -> str:
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)


COMPACT_MARKER = "pb64:"


def encode_compact(message: Message) -> str:
    """The binary protobuf form of ``message``, base64 under COMPACT_MARKER."""
    return COMPACT_MARKER + base64.b64encode(message.SerializeToString()).decode("ascii")


def decode(cls: type[M], raw: str | bytes) -> M:
    """A record stored by :func:`encode` or :func:`encode_compact`."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    if text.startswith(COMPACT_MARKER):
        return cls.FromString(base64.b64decode(text[len(COMPACT_MARKER) :], validate=True))
    return json_format.Parse(text, cls(), ignore_unknown_fields=True)
