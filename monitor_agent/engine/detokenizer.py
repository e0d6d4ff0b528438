"""Incremental detokenisation: turn a stream of token ids into a stream of text.

Decoding one token at a time is wrong for byte-level and SentencePiece vocabularies (a
character may span tokens; a leading space depends on the previous token), so each step
decodes a short window of recent ids and emits only the text that has become final. Text
ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token
completes it, or until the stream ends.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context, so the first generated token decodes as it would
# mid-text (e.g. keeps its leading space).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        # ids[prefix:read] is text already emitted; ids[read:] is still pending.
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it makes final ('' while incomplete)."""
        self._ids.append(token_id)
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """All text still held back (an incomplete character decodes as U+FFFD)."""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(emitted) :]
