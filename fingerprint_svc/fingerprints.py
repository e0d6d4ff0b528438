"""Fingerprints: a registered checkpoint cut to its first n decoder layers.

A fingerprint holds the token embedding, decoder layers ``0 .. n-1``, the final norm, the
LM head, ``config.json`` with the layer count edited (:func:`config_with_layers`) and the
tokenizer files, so that the engine loads it like any checkpoint. It is written by
reading only those tensors, each as a byte range of its shard streamed in
``READ_CHUNK_BYTES`` pieces (``safetensors_format.read_range``) into the safetensors writer: the rest of the checkpoint is
never read, and no tensor is ever whole in memory (an LM head of a 70B model is 1 GiB).
The bytes are copied unchanged, so the fingerprint keeps the checkpoint's dtype
(bfloat16 included, which numpy cannot represent; this is also why the cutter reads the
byte ranges the safetensors header names rather than ``safe_open(...).get_tensor``,
which needs torch for bfloat16 and would materialise each tensor whole).

Layout, under the models root so that every agent can read it:

    $ISERVE_MODELS_ROOT/.fingerprints/<content-hash>/L<n>/
        config.json  model.safetensors  tokenizer.json  …  fingerprint.json

``<content-hash>`` (:func:`content_hash`) identifies the source checkpoint by content, not
by path, so two registrations of the same checkpoint (or a copy of it) share their
fingerprints. It is the first 32 hex digits of a SHA-256 over: the canonical JSON of
``config.json``; for each ``*.safetensors`` shard in name order its name, size, raw
header, and the SHA-256 of its first and of its last MiB; and the full content of each
tokenizer file the fingerprint copies. That reads about 2 MiB per shard; a change to
tensor bytes between the first and last MiB of a shard that keeps its header and size
goes unnoticed (accepted: checkpoints are not edited in place in practice).

A fingerprint is written into a temporary directory next to its final place and renamed
into place, so a directory ``L<n>`` is always complete; when two cutters race, the first
rename wins and the other's copy is discarded. ``fingerprint.json`` records what was cut
from what, for people.

Each model that profiles on a content's fingerprints is recorded in
``<content-hash>/users/`` (one file per model id, named by its hash, holding the id)
before the fingerprint is looked up or cut; :meth:`FingerprintCache.release` takes a
deleted model's record away and removes the content's fingerprints once no model is
left in it (they are GBs for a large model: its embedding and LM head are whole in
each). Both steps hold an exclusive ``flock`` on ``.fingerprints/.lock``, so a release
in one process never removes what a job in another has just been given.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from services.models.checkpoint import (
    CONFIG_FILE,
    read_config,
    read_safetensors_index,
    weight_files,
)
from services.models.families import config_with_layers, parse_config
from services.models.safetensors_format import (
    TensorInfo,
    data_start,
    read_range,
    write_safetensors,
)
from services.models.tied_head import resolve_tied_head

log = logging.getLogger(__name__)

FINGERPRINTS_DIR = ".fingerprints"
MANIFEST_FILE = "fingerprint.json"
USERS_DIR = "users"
LOCK_FILE = ".lock"
WEIGHTS_FILE = "model.safetensors"
# Files copied with the weights: what the engine and tokenizers read besides them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
HASH_SAMPLE_BYTES = 1 << 20
_HASH_DIGITS = 32
_LENGTH_PREFIX_BYTES = 8


@dataclass(frozen=True)
class Fingerprint:
    """A checkpoint an agent can load: a cut fingerprint, or the model itself when the
    requested layer count is the model's (``full_model``)."""

    # Directory relative to the models root (what RunProfilingJob names).
    checkpoint_path: str
    num_layers: int
    full_model: bool
    # Bytes of the tensors as stored.
    weight_bytes: int
    content_hash: str


def content_hash(checkpoint_dir: Path) -> str:
    """The cache key of ``checkpoint_dir``'s fingerprints (see the module docstring)."""
    digest = hashlib.sha256(b"iserve-fingerprint-v1\0")
    config = read_config(checkpoint_dir)
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    # The files transformers loads, not leftovers beside them (a re-save with another
    # shard size leaves them), which would change the key without changing the model.
    for shard in weight_files(checkpoint_dir):
        size = shard.stat().st_size
        digest.update(f"\0shard {shard.name} {size}\0".encode())
        with shard.open("rb") as f:
            prefix = f.read(_LENGTH_PREFIX_BYTES)
            digest.update(prefix)
            if len(prefix) == _LENGTH_PREFIX_BYTES:
                (header_len,) = struct.unpack("<Q", prefix)
                digest.update(f.read(min(header_len, size)))
            f.seek(0)
            digest.update(hashlib.sha256(f.read(HASH_SAMPLE_BYTES)).digest())
            f.seek(max(0, size - HASH_SAMPLE_BYTES))
            digest.update(hashlib.sha256(f.read(HASH_SAMPLE_BYTES)).digest())
    for name in TOKENIZER_FILES:
        path = checkpoint_dir / name
        if path.is_file():
            digest.update(f"\0file {name}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:_HASH_DIGITS]


def cut_fingerprint(checkpoint_dir: Path, out_dir: Path, num_layers: int) -> int:
    """Write the first ``num_layers`` layers of ``checkpoint_dir`` as a checkpoint in
    ``out_dir`` (created; must not hold weights yet); returns the weight bytes written.

    Reads only the headers of the source shards and the byte ranges of the tensors the
    fingerprint keeps. ValueError when ``num_layers`` is not below the model's layer
    count or a tensor's stored shape disagrees with the config.
    """
    config = read_config(checkpoint_dir)
    index = read_safetensors_index(checkpoint_dir)
    spec = resolve_tied_head(checkpoint_dir, parse_config(config), index)
    if not 1 <= num_layers < spec.num_layers:
        raise ValueError(
            f"a fingerprint needs 1 to {spec.num_layers - 1} layers of the model's "
            f"{spec.num_layers}, got {num_layers}"
        )
    cut_config = config_with_layers(config, num_layers)
    if not spec.tie_word_embeddings:
        # A head of its own under a config that ties it (or Falcon's default): the
        # fingerprint keeps that head, as the model serves it.
        cut_config["tie_word_embeddings"] = False
    cut_spec = parse_config(cut_config)
    layout: list[tuple[str, str, tuple[int, ...]]] = []
    sources: dict[str, TensorInfo] = {}
    for name, shape in cut_spec.expected_tensors().items():
        info = index.get(name)
        if info is None:
            raise ValueError(f"checkpoint {checkpoint_dir.name!r} lacks tensor {name!r}")
        if info.shape != shape:
            raise ValueError(
                f"tensor {name!r} has shape {list(info.shape)}; the config implies {list(shape)}"
            )
        layout.append((name, info.dtype, info.shape))
        sources[name] = info
    starts = {info.file: data_start(checkpoint_dir / info.file) for info in sources.values()}

    def tensor_chunks(name: str) -> Iterator[bytes]:
        info = sources[name]
        base = starts[info.file]
        first, last = info.data_offsets
        return read_range(checkpoint_dir / info.file, base + first, base + last)

    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_safetensors(out_dir / WEIGHTS_FILE, layout, tensor_chunks)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cut_config, indent=2) + "\n", encoding="utf-8")
    for file_name in TOKENIZER_FILES:
        if (checkpoint_dir / file_name).is_file():
            shutil.copyfile(checkpoint_dir / file_name, out_dir / file_name)
    return written


class FingerprintCache:
    """Fingerprints of the checkpoints under one models root, cut once per content."""

    def __init__(self, models_root: Path):
        self.models_root = models_root.resolve()
        self.root = self.models_root / FINGERPRINTS_DIR

    def fingerprint(
        self, checkpoint_path: str, num_layers: int, user: str | None = None
    ) -> Fingerprint:
        """The ``num_layers``-layer fingerprint of the checkpoint at ``checkpoint_path``
        (relative to the models root), cut now unless the cache holds it. With
        ``num_layers`` equal to the model's layer count, the checkpoint itself.
        ``user``: the model id the fingerprint is for, recorded first so that a
        :meth:`release` of another model keeps it."""
        source = (self.models_root / checkpoint_path).resolve()
        key = content_hash(source)
        model_layers = parse_config(read_config(source)).num_layers
        if num_layers == model_layers:
            weights = sum(info.nbytes for info in read_safetensors_index(source).values())
            return Fingerprint(checkpoint_path, num_layers, True, weights, key)
        final = self.root / key / f"L{num_layers}"
        if user is not None:
            with self._locked():
                users = final.parent / USERS_DIR
                users.mkdir(parents=True, exist_ok=True)
                (users / _user_file(user)).write_text(user + "\n", encoding="utf-8")
        if not (final / MANIFEST_FILE).is_file():
            self._cut(source, final, key, num_layers)
            if user is not None:
                self._check_still_used(final.parent, user)
        manifest = json.loads((final / MANIFEST_FILE).read_text(encoding="utf-8"))
        return Fingerprint(
            str(final.relative_to(self.models_root)),
            num_layers,
            False,
            int(manifest["weight_bytes"]),
            key,
        )

    def release(self, user: str, sources: Iterable[str] = (), kept: Iterable[str] = ()) -> int:
        """Take model ``user`` off every content's fingerprints and remove those no model
        is left on. A content without a ``users`` record (cut before they were kept) is
        removed when its fingerprints were cut from one of ``sources`` (the deleted
        model's checkpoint paths) and from none of ``kept`` (the remaining models').
        Returns the bytes freed. A content that cannot be removed (the disk's error) is
        logged and left; whoever needs it next uses or cuts it again."""
        if not self.root.is_dir():
            return 0
        sources = {_normal(p) for p in sources} - {_normal(p) for p in kept}
        freed = 0
        try:
            with self._locked():
                for content in sorted(self.root.iterdir()):
                    if content.is_dir() and not content.is_symlink():
                        try:
                            freed += self._release_one(content, user, sources)
                        except OSError as exc:
                            log.warning(
                                "fingerprints %s of model %r not removed: %s", content, user, exc
                            )
        except OSError as exc:  # the lock file cannot be made (a read-only models root)
            log.warning("fingerprints of model %r not removed: %s", user, exc)
        return freed

    def _release_one(self, content: Path, user: str, sources: set[str]) -> int:
        users = content / USERS_DIR
        if users.is_dir():
            (users / _user_file(user)).unlink(missing_ok=True)
            if any(users.iterdir()):
                return 0
        elif not sources & _cut_from(content):
            return 0
        size = _tree_bytes(content)
        shutil.rmtree(content)
        log.info("removed fingerprints %s (%d bytes): no model profiles on them", content, size)
        return size

    def _check_still_used(self, content: Path, user: str) -> None:
        """After a cut: when ``user`` was released meanwhile (its model deleted while its
        job cut), remove what the cut put back unless another model came to use it."""
        with self._locked():
            users = content / USERS_DIR
            if (users / _user_file(user)).is_file():
                return
            if not (users.is_dir() and any(users.iterdir())):
                shutil.rmtree(content, ignore_errors=True)
        raise FileNotFoundError(f"fingerprints {content} were released while cut for {user!r}")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _cut(self, source: Path, final: Path, key: str, num_layers: int) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            started = time.perf_counter()
            weight_bytes = cut_fingerprint(source, temporary, num_layers)
            manifest = {
                "content_hash": key,
                "source": str(source.relative_to(self.models_root)),
                "num_layers": num_layers,
                "weight_bytes": weight_bytes,
                "cut_seconds": round(time.perf_counter() - started, 3),
                "created_at_unix_ms": int(time.time() * 1000),
            }
            (temporary / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
            if final.exists() and not (final / MANIFEST_FILE).is_file():
                shutil.rmtree(final)  # left incomplete by something other than a cutter
            try:
                os.rename(temporary, final)
            except OSError:
                if not (final / MANIFEST_FILE).is_file():
                    raise
                # Another cutter renamed the same fingerprint into place first.
        finally:
            shutil.rmtree(temporary, ignore_errors=True)


def _user_file(user: str) -> str:
    return hashlib.sha256(user.encode("utf-8")).hexdigest()[:_HASH_DIGITS]


def _normal(path: str) -> str:
    return os.path.normpath(path.strip("/"))


def _cut_from(content: Path) -> set[str]:
    """The checkpoint paths (relative to the models root) a content's fingerprints name."""
    found = set()
    for manifest in content.glob(f"L*/{MANIFEST_FILE}"):
        try:
            found.add(_normal(str(json.loads(manifest.read_text(encoding="utf-8"))["source"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _tree_bytes(directory: Path) -> int:
    total = 0
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total
