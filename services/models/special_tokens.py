"""Special tokens: the ones a prompt gets, and the configured ids the engine may use.

Prompt text is encoded as transformers' ``AutoTokenizer`` (5.x) encodes it, since that is
what users compare iserve's outputs with. Read from its source and checked against it by
``tests/unit/test_models_special_tokens.py``, its rule for a checkpoint with a
``tokenizer.json`` (which iserve requires) is:

- a prompt gets exactly the special tokens ``tokenizer.json``'s post-processor adds (a
  ``TemplateProcessing`` that prepends BOS, ``RobertaProcessing``, a ``Sequence``…), and
  none when there is no post-processor;
- ``tokenizer_config.json``'s ``add_bos_token`` and ``add_eos_token`` change nothing:
  ``PreTrainedTokenizerBase._from_pretrained`` discards them whenever ``tokenizer.json``
  exists (transformers 4's ``LlamaTokenizerFast`` honoured them; 5 does not);
- whichever class it picks (``TokenizersBackend`` for llama, mistral and falcon,
  ``Qwen2Tokenizer`` for qwen2, ``GPT2Tokenizer`` for gptj, or the one
  ``tokenizer_config.json`` names) keeps the file's post-processor; the special tokens a
  class defaults to (GPT-2's ``<|endoftext|>``) or that ``tokenizer_config.json`` and
  ``special_tokens_map.json`` name are registered, never added to a prompt;
- a ``llama`` model's ``LlamaTokenizer`` or ``CodeLlamaTokenizer`` runs with the class's
  own pre-tokenizer and decoder, not the file's normalizer
  (``services.models.tokenizer_files.as_transformers_runs_it``), which the engines'
  loader applies.

The EOS ids a generation stops on are ``generation_config.json``'s whenever that file is
read, even when it names none, and ``config.json``'s only without it (:func:`stop_eos_ids`).

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
from typing import TYPE_CHECKING

from services.models import json_text
from services.models.checkpoint_files import read_checkpoint_text
from services.models.errors import InvalidCheckpoint

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger("iserve.models")

GENERATION_CONFIG_FILE = "generation_config.json"


def encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` with the special tokens ``tokenizer.json``'s post-processor
    adds, and no others (see the module docstring); without any when not
    ``add_special_tokens`` (a rendered chat template holds its own, and transformers'
    ``apply_chat_template`` encodes it so); ValueError when the tokenizer cannot encode
    ``text`` (a word-level vocabulary with no unknown-word token, say)."""
    try:
        # encode_batch lets go of the GIL while it works (encode holds it): a worker's
        # other threads, which step and stream the other sequences, go on meanwhile.
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    except Exception as exc:  # the tokenizers library raises its own Exception
        raise ValueError(f"the model's tokenizer cannot encode this prompt: {exc}") from None


# Characters one token may stand for at most, beyond the vocabulary's longest piece: an
# unknown-word token covers a whole word (WordPiece's cap is 100 characters).
_UNKNOWN_WORD_CHARS = 128
# Normalizers (NFKC and the like) may fold a few characters into one before encoding.
_NORMALIZER_FOLD = 4


def max_prompt_chars(tokenizer: Tokenizer, max_tokens: int) -> int:
    """A text longer than this cannot encode to ``max_tokens`` tokens or fewer with
    ``tokenizer``: no token stands for more characters than the vocabulary's longest
    piece (or an unknown word), allowing for normalizers that fold characters. Lets a
    worker refuse a huge prompt without tokenizing it."""
    return _chars_bound(longest_piece(tokenizer), max_tokens)


def _chars_bound(longest: int, max_tokens: int) -> int:
    return _NORMALIZER_FOLD * max_tokens * _chars_per_token(longest)


def _chars_per_token(longest: int) -> int:
    return max(longest, _UNKNOWN_WORD_CHARS)


def longest_piece(tokenizer: Tokenizer) -> int:
    """Characters of the vocabulary's longest piece, added tokens included."""
    return max((len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True)), default=1)


class PromptTooLong(ValueError):
    """A prompt text longer than ``limit`` tokens, found so without encoding all of it:
    ``counted`` tokens (more than ``limit``) in its first ``chars_read`` of ``chars``
    characters (``chars_read`` 0: refused on its length alone, unread)."""

    def __init__(self, message: str, *, limit: int, chars: int, chars_read: int, counted: int):
        super().__init__(message)
        self.limit = limit
        self.chars = chars
        self.chars_read = chars_read
        self.counted = counted


# A text of up to this many characters per token of its limit is encoded whole at once:
# English runs about 4 characters a token, so a prompt that fits is within it.
_WHOLE_CHARS_PER_TOKEN = 8
# Each longer look at a long text reads this many times the characters of the one before.
_PREFIX_GROWTH = 4
# A prefix is cut before a whitespace character found within this many characters of
# its end, where pre-tokenizers split words anyway; else where it falls.
_CUT_SEARCH_CHARS = 256


class PromptEncoder:
    """A deployment's prompts to token ids: :func:`encode_prompt`, refusing a text too
    long for its limit (PromptTooLong) without encoding all of it. A tokenizer takes
    about a second on half a megabyte, during which the worker's other prompts wait, so
    one client's hostile prompts would delay everyone's first tokens:

    - a text longer than the limit's tokens can stand for with this vocabulary
      (:func:`max_prompt_chars`) is refused unread (a cap, since a tokenizer that gives
      a run of unknown characters one token, or drops whitespace, may encode more
      characters to a token);
    - a text longer than ``_WHOLE_CHARS_PER_TOKEN`` characters per token of the limit
      is read by growing prefixes first. A prefix's tokens, less the few a cut inside
      the text can add (``cut_slack``: the tokens either side of the cut may encode
      differently apart), are at most the whole text's, so a prefix that encodes to
      more than the limit plus that refuses the text. The last prefix is the text
      itself, whose ids are the answer, so a long text within its limit costs at most
      a third more to encode (``_PREFIX_GROWTH``).

    With ``vocab_size``, a text that encodes to an id the model has no embedding row for
    (an added token past config.json's vocab_size, which registration accepts as
    transformers does) is refused naming that token, not its id alone.

    Both engines encode through one."""

    def __init__(self, tokenizer: Tokenizer, max_seq_len: int, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self._longest: int | None = None  # from the vocabulary, when first needed

    @property
    def longest(self) -> int:
        """Characters of the vocabulary's longest piece."""
        if self._longest is None:
            self._longest = longest_piece(self.tokenizer)
        return self._longest

    @property
    def cut_slack(self) -> int:
        """Tokens a prefix may encode to beyond the whole text's share of them: a cut
        splits at most the tokens around it, each of at most ``longest`` characters,
        into pieces of a byte each at worst (byte-level vocabularies); a normalizer may
        fold characters across it."""
        return 2 * _NORMALIZER_FOLD * max(self.longest, 4)

    def __call__(
        self, text: str, add_special_tokens: bool = True, max_tokens: int = 0
    ) -> list[int]:
        """``text``'s ids; PromptTooLong when it surely has more than ``max_tokens``
        tokens (0, or above ``max_seq_len``: ``max_seq_len``)."""
        limit = min(max_tokens, self.max_seq_len) if max_tokens > 0 else self.max_seq_len
        chars, slack = len(text), self.cut_slack
        max_chars = _chars_bound(self.longest, limit)
        if chars > max_chars:
            # A cap more than a proof: a tokenizer that gives a whole run of unknown
            # characters one token, or drops whitespace, may encode it to fewer.
            raise PromptTooLong(
                f"prompt of {chars} characters is longer than a prompt of {limit} tokens "
                f"is read here: at most {max_chars} characters ({_NORMALIZER_FOLD} x "
                f"{limit} tokens x {_chars_per_token(self.longest)} characters, "
                "the most this vocabulary's pieces stand for)",
                limit=limit,
                chars=chars,
                chars_read=0,
                counted=0,
            )
        size = _WHOLE_CHARS_PER_TOKEN * max(limit, 1)
        while chars > size:
            cut = _prefix_cut(text, size)
            counted = len(encode_prompt(self.tokenizer, text[:cut], add_special_tokens))
            if counted - slack > limit:
                raise PromptTooLong(
                    f"prompt has more than {limit} tokens: its first {cut} of {chars} "
                    f"characters alone encode to {counted}",
                    limit=limit,
                    chars=chars,
                    chars_read=cut,
                    counted=counted,
                )
            size *= _PREFIX_GROWTH
        ids = encode_prompt(self.tokenizer, text, add_special_tokens)
        if self.vocab_size is not None:
            self._check_vocabulary(ids, self.vocab_size)
        return ids

    def _check_vocabulary(self, ids: list[int], vocab_size: int) -> None:
        past = sorted({token for token in ids if not 0 <= token < vocab_size})
        if not past:
            return
        pieces = ", ".join(
            f"{self.tokenizer.id_to_token(token)!r} ({token})" for token in past[:5]
        ) + (f" and {len(past) - 5} more" if len(past) > 5 else "")
        raise ValueError(
            f"the prompt text holds token(s) {pieces} that the model's vocabulary of "
            f"{vocab_size} ids has no embedding for: the tokenizer adds them past "
            "config.json's vocab_size; leave them out of the prompt"
        )


def _prefix_cut(text: str, size: int) -> int:
    """Where a prefix of about ``size`` characters of ``text`` ends: before the last
    whitespace character within ``_CUT_SEARCH_CHARS`` of ``size``, else at ``size``."""
    low = max(1, size - _CUT_SEARCH_CHARS)
    for at in range(size, low - 1, -1):
        if text[at].isspace():
            return at
    return size


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


def generation_eos_ids(checkpoint_dir: Path, vocab_size: int) -> frozenset[int] | None:
    """The EOS ids of the checkpoint's ``generation_config.json`` (see
    :func:`stop_eos_ids`), those outside the vocabulary dropped: its ``eos_token_id`` (an
    id or a list), and none (an empty set) when the key is absent or null. None when
    there is no such file, or it is not JSON (transformers then ignores it, and iserve
    warns).

    InvalidCheckpoint when the file is JSON but not an object, which transformers'
    ``from_pretrained`` fails on."""
    path = checkpoint_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        generation = json_text.loads(read_checkpoint_text(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning(
            "%s is not valid JSON (%s); ignoring it and stopping on config.json's EOS ids, "
            "as transformers does",
            GENERATION_CONFIG_FILE,
            exc,
        )
        return None
    if not isinstance(generation, dict):
        raise InvalidCheckpoint(f"{GENERATION_CONFIG_FILE} is malformed: not a JSON object")
    value = generation.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return frozenset(ids_in_vocabulary(f"{GENERATION_CONFIG_FILE} eos_token_id", ids, vocab_size))


def stop_eos_ids(
    config_eos_ids: Iterable[int], checkpoint_dir: Path, vocab_size: int
) -> frozenset[int]:
    """The EOS ids a generation stops on, as transformers' (5.x) ``generate`` has them.

    ``from_pretrained`` reads the model's generation config from
    ``generation_config.json`` (``GenerationConfig.from_pretrained``), and ``generate``
    stops on its ``eos_token_id`` alone. Only when that file is missing or is not JSON
    does it build one from ``config.json`` (``_from_model_config``, which copies its
    ``eos_token_id``), so:

    - no ``generation_config.json`` (or one that is not JSON): ``config.json``'s ids
      (``config_eos_ids``, already within the vocabulary);
    - a ``generation_config.json`` naming ``eos_token_id``: those ids alone, whatever
      ``config.json`` says;
    - a ``generation_config.json`` without ``eos_token_id``, or with it null: none; the
      generation runs to its token limit.
    """
    generation = generation_eos_ids(checkpoint_dir, vocab_size)
    return frozenset(config_eos_ids) if generation is None else generation
