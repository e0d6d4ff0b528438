"""Argument types of the CLI's numeric options.

The requests carry counts as protobuf ``uint32`` (a seed as ``uint64``), so a negative or
huge value would otherwise reach the message and fail there as "Value out of range";
argparse instead names the option and its range, and exits with status 2 before anything
is sent (``argparse.ArgumentTypeError`` is argparse's own way to refuse a value).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from services.errors import InvalidArgument
from services.ids import check_model_id
from services.proto_limits import MAX_DEVICE_BYTES, UINT32_MAX

__all__ = [
    "add_token_limits",
    "device_memory_gib",
    "positive_number",
    "usage_error",
    "watch_seconds",
    "whole_number",
]

# A device's memory in GiB: from 1 MiB (less rounds to nothing) to 1 PiB (a uint64 of
# bytes holds 16 EiB; no device comes near it).
MIN_DEVICE_MEMORY_GIB = 1 / 1024
MAX_DEVICE_MEMORY_GIB = float(MAX_DEVICE_BYTES >> 30)


def whole_number(minimum: int = 1, maximum: int = UINT32_MAX) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``minimum`` to ``maximum``."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be a whole number from {minimum} to {maximum}, got {text!r}"
            )
        return value

    return parse


# The longest refresh period of `iserve status --watch`: a day.
MAX_WATCH_SECONDS = 86400.0
# Each refresh asks every service: faster than this was thousands of calls a minute (a
# tester's 1e-9 redrew 3,558 times in 120 s) for figures that change each second.
MIN_WATCH_SECONDS = 0.1


def usage_error(message: str) -> NoReturn:
    """A usage error found after parsing (options that do not go together), reported as
    argparse reports its own: ``error: message`` on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def watch_seconds(text: str) -> float:
    """An argparse ``type``: a refresh period, a finite number of seconds from
    MIN_WATCH_SECONDS to a day (``sleep`` takes no negative, NaN or infinite time)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and MIN_WATCH_SECONDS <= value <= MAX_WATCH_SECONDS):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from {MIN_WATCH_SECONDS:g} to {MAX_WATCH_SECONDS:g}, "
            f"got {text!r}"
        )
    return value


def model_id_argument(text: str) -> str:
    """An argparse ``type``: a model id (``services.ids``' rule), named as the option."""
    try:
        check_model_id(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("invalid model_id ")) from None
    return text


def nonempty(text: str) -> str:
    """An argparse ``type``: any text but the empty one (``--out ""`` wrote into the
    current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path, not empty")
    return text


def id_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated ids, at least one, none empty (``--models
    ,,`` named no model and fell back to every model)."""
    ids = [part.strip() for part in text.split(",")]
    if not all(ids):
        raise argparse.ArgumentTypeError(f"must be comma-separated ids, none empty, got {text!r}")
    return ids


def positive_number(text: str) -> float:
    """An argparse ``type``: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def milliseconds_field_seconds(text: str) -> float:
    """An argparse ``type``: seconds above 0 that a request's uint32 milliseconds carry
    (at most 4,294,967 s, 49 days). 1e308 printed a traceback, and 4294968 "Value out of
    range" without the option's name (a tester)."""
    value = positive_number(text)
    most = UINT32_MAX // 1000
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most} seconds, got {text!r}")
    return value


def device_memory_gib(text: str) -> float:
    """An argparse ``type``: a device's memory in GiB, from 1 MiB to 1 PiB."""
    value = positive_number(text)
    if not MIN_DEVICE_MEMORY_GIB <= value <= MAX_DEVICE_MEMORY_GIB:
        raise argparse.ArgumentTypeError(
            f"must be a number of GiB from 1/1024 (1 MiB) to {MAX_DEVICE_MEMORY_GIB:.0f} "
            f"(1 PiB), got {text!r}"
        )
    return value


def add_token_limits(parser: argparse.ArgumentParser, input_help: str, output_help: str) -> None:
    """``--max-input`` and ``--max-output``: whole numbers, 0 (not given) meaning the
    deployer's default (``services.token_limits``)."""
    parser.add_argument("--max-input", type=whole_number(), default=0, help=input_help)
    parser.add_argument("--max-output", type=whole_number(), default=0, help=output_help)
