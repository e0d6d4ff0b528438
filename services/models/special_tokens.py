"""Special tokens: the configured ids the engine may use.

Special-token ids in ``config.json`` or ``generation_config.json`` outside the model's
vocabulary (Hugging Face's GPT-J config carries 50256 whatever the vocabulary) name no
row of the embedding or the LM head, so the model can neither read nor emit them. They
are dropped with a warning rather than refused, since transformers loads and generates
with such checkpoints: the engine never inserts them or stops on them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from services.models.errors import InvalidCheckpoint

__all__ = ["GENERATION_CONFIG_FILE", "generation_eos_ids", "ids_in_vocabulary"]

log = logging.getLogger("iserve.models")

GENERATION_CONFIG_FILE = "generation_config.json"


def ids_in_vocabulary(source: str, ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    """``ids`` less those outside ``[0, vocab_size)``, each dropped with a warning that
    names ``source`` (e.g. "config eos_token_id")."""
    kept = []
    for token in ids:
        if 0 <= token < vocab_size:
            kept.append(token)
        else:
            log.warning(
                "%s %d is outside the vocabulary (%d tokens); ignoring it",
                source,
                token,
                vocab_size,
            )
    return tuple(kept)


def generation_eos_ids(checkpoint_dir: Path, vocab_size: int) -> frozenset[int]:
    """EOS ids from ``generation_config.json`` (chat models often list more than
    ``config.json``), those outside the vocabulary dropped; empty without the file.

    InvalidCheckpoint when the file is not a JSON object."""
    path = checkpoint_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return frozenset()
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise InvalidCheckpoint(f"{GENERATION_CONFIG_FILE} is malformed: {exc}") from exc
    values = value if isinstance(value, list) else [value]
    ids = (v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return frozenset(ids_in_vocabulary(f"{GENERATION_CONFIG_FILE} eos_token_id", ids, vocab_size))
