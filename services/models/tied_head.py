"""Whether a checkpoint's LM head is its token embedding, decided as transformers decides.

transformers 5 (``PreTrainedModel.tie_weights``, which ``from_pretrained`` runs) ties the
LM head to the token embedding when the config's ``tie_word_embeddings`` is true (Falcon's
config class defaults to true, the other families' to false), except when the
checkpoint holds both tensors and their loaded values differ (``torch.equal``): it then
warns that it "will NOT tie them", and the model keeps the checkpoint's own head. A
config saying tied over a checkpoint with a head of its own happens (a Falcon config
that omits the field, a fine-tune that untied the head and kept the config), and serving
the embedding as the head there generates other tokens than transformers does.

So the decision reads both tensors when a checkpoint is validated, a chunk of each at a
time, stopping at the first chunk that differs (a distinct head differs in its first
rows); only a head that duplicates the embedding is read to its end. Values are compared
as stored, in float32 (which holds every F16 and BF16 value exactly), NaN unequal to
itself as in ``torch.equal``. The spec that comes out says ``tie_word_embeddings`` False
for a distinct head, and everything downstream follows the spec: the shape registration
records (and the memory reserved for it: an untied head is another vocab × hidden
matrix), and the loader at every tensor- and pipeline-parallel layout. The decision is a
function of the checkpoint's bytes alone, so registration and every worker that
validates the same files reach the same one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from services.models.arch import ArchSpec
from services.models.safetensors_format import (
    FLOAT_DTYPES,
    TensorInfo,
    decode_float_tensor,
    read_tensor_chunks,
)

log = logging.getLogger("iserve.models")

LM_HEAD = "lm_head.weight"
# Elements of each tensor compared at a time: 16 MiB of float32 apiece.
_CHUNK_ELEMENTS = 1 << 22


def resolve_tied_head(
    directory: Path, spec: ArchSpec, tensors: Mapping[str, TensorInfo]
) -> ArchSpec:
    """``spec`` as transformers loads its checkpoint: with ``tie_word_embeddings`` False
    when the config ties the LM head but ``tensors`` (the checkpoint's, in
    ``directory``) hold an ``lm_head.weight`` whose values differ from the embedding's;
    ``spec`` itself otherwise. A head of another shape differs (validation then names
    its shape)."""
    head = tensors.get(LM_HEAD)
    embedding = tensors.get(spec.embedding_tensor)
    if not spec.tie_word_embeddings or head is None or embedding is None:
        return spec
    if _same_values(directory, embedding, head):
        return spec
    log.warning(
        "%s: config.json ties the LM head to %s, but the checkpoint's %s has other "
        "values; serving the checkpoint's own head, as transformers does (set "
        "tie_word_embeddings to false in config.json to silence this)",
        directory,
        spec.embedding_tensor,
        LM_HEAD,
    )
    return replace(spec, tie_word_embeddings=False)


def is_duplicate_head(spec: ArchSpec, name: str) -> bool:
    """Whether ``name`` is an LM head that a spec from :func:`resolve_tied_head` left
    tied, and so one holding the embedding's values: nothing the engine needs to read."""
    return spec.tie_word_embeddings and name == LM_HEAD


def _same_values(directory: Path, first: TensorInfo, second: TensorInfo) -> bool:
    if first.shape != second.shape or not {first.dtype, second.dtype} <= set(FLOAT_DTYPES):
        return False  # validation refuses the head's shape or either's dtype by name
    chunks = zip(
        read_tensor_chunks(directory, first, _CHUNK_ELEMENTS),
        read_tensor_chunks(directory, second, _CHUNK_ELEMENTS),
        strict=True,
    )
    return all(
        np.array_equal(decode_float_tensor(a, first.dtype), decode_float_tensor(b, second.dtype))
        for a, b in chunks
    )
