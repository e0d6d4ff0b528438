"""The largest values the API's unsigned protobuf fields carry.

A count or duration beyond them cannot be put in a request message at all (protobuf
raises "Value out of range" while building it), so every edge that takes such numbers
from a user (the CLI, the HTTP gateway, file importers) refuses them against these, with
the field's name, before building a message.
"""

from __future__ import annotations

__all__ = ["MAX_DEVICE_BYTES", "UINT32_MAX", "UINT64_MAX"]

# uint32 fields: token counts, batch sizes, parallel degrees, milliseconds.
UINT32_MAX = 2**32 - 1
# uint64 fields: seeds, byte counts.
UINT64_MAX = 2**64 - 1
# A device's memory in any request (estimates, plans' simulated devices): 1 PiB, past
# any device built. 2**64 - 1 bytes, what a uint64 holds, came back from the estimator
# as 2**64 (a float's rounding), which no reply can carry: INTERNAL (a tester).
MAX_DEVICE_BYTES = 1 << 50
