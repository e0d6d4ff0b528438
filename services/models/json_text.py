"""JSON text from a checkpoint's files, with every refusal of Python's parser as one error.

``json.loads`` refuses a document in three ways: ``json.JSONDecodeError`` for bad syntax,
``RecursionError`` for nesting deeper than the interpreter's recursion limit (a 100,000
deep ``[[[…]]]`` of a few hundred kilobytes), and a plain ``ValueError`` for an integer
past ``sys.get_int_max_str_digits``. Callers handle the first; a ``config.json`` of the
second kind ended a registration with INTERNAL and a traceback. :func:`loads` raises
all three as ``json.JSONDecodeError``.
"""

from __future__ import annotations

import json
from typing import Any


def loads(text: str, **options: Any) -> Any:
    """``json.loads(text, **options)``; json.JSONDecodeError for any document it refuses."""
    try:
        return json.loads(text, **options)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise json.JSONDecodeError(str(exc), text, 0) from None
