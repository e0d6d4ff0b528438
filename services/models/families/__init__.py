"""The model families iserve serves, each a :class:`Family` entry in ``FAMILIES``.

A family knows three things about its Hugging Face checkpoints: how to read a
``config.json`` into an :class:`~services.models.arch.ArchSpec`, which tensors one decoder
layer holds (names, shapes, and the engine parameters each fills), and how to write a
``config.json`` for a synthetic checkpoint. Everything else (embedding, final norm, LM
head, stage slicing) is common and lives in ``arch.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from services.models.arch import ArchSpec
from services.models.errors import InvalidConfig, UnsupportedArchitecture
from services.models.families import falcon, gptj, llama
from services.models.families.family import ConfigRequest, Family
from services.models.special_tokens import ids_in_vocabulary

__all__ = [
    "FAMILIES",
    "ConfigRequest",
    "Family",
    "config_with_layers",
    "family_of",
    "parse_config",
    "supported_model_types",
]


def _registry() -> dict[str, Family]:
    families = [llama.LLAMA, llama.MISTRAL, llama.QWEN2, falcon.FALCON, gptj.GPTJ]
    return {family.name: family for family in families}


FAMILIES: dict[str, Family] = _registry()


def family_of(cfg: Mapping[str, Any]) -> Family:
    """The family a config belongs to, by ``model_type`` and ``architectures``."""
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    if model_type is None and not architectures:
        raise InvalidConfig("config has neither 'model_type' nor 'architectures'")
    if architectures and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise InvalidConfig(f"'architectures' must be a list of strings, got {architectures!r}")
    for family in FAMILIES.values():
        if model_type is not None and model_type not in family.model_types:
            continue
        if architectures and not set(architectures) & set(family.architectures):
            if model_type is None:
                continue
            raise UnsupportedArchitecture(
                f"architectures {architectures} are not supported for model_type "
                f"{model_type!r}; supported: {list(family.architectures)}"
            )
        return family
    what = f"model_type {model_type!r}" if model_type is not None else f"{architectures}"
    supported = sorted(t for family in FAMILIES.values() for t in family.model_types)
    raise UnsupportedArchitecture(f"{what} is not supported; supported model types: {supported}")


def parse_config(cfg: Mapping[str, Any]) -> ArchSpec:
    """The spec of a parsed ``config.json``, carrying its family's checkpoint layout.

    Raises UnsupportedArchitecture for families or features iserve cannot run, and
    InvalidConfig for missing or inconsistent fields; both messages name the field.
    BOS and EOS ids outside the vocabulary are dropped with a warning (see
    :mod:`services.models.special_tokens`).
    """
    if not isinstance(cfg, Mapping):
        raise InvalidConfig(f"config must be a JSON object, got {type(cfg).__name__}")
    family = family_of(cfg)
    _refuse_experts(cfg)
    spec = family.parse(cfg, family.name)
    bos = () if spec.bos_token_id is None else (spec.bos_token_id,)
    bos = ids_in_vocabulary("config bos_token_id", bos, spec.vocab_size)
    eos = ids_in_vocabulary("config eos_token_id", spec.eos_token_ids, spec.vocab_size)
    return replace(spec, bos_token_id=bos[0] if bos else None, eos_token_ids=eos, layout=family)


# The fields by which Hugging Face configs give a mixture of experts its experts
# (Mixtral, Qwen2-MoE and OLMoE, DeepSeek, DBRX-style).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _more_than_one(value: Any) -> bool:
    """Whether a config's expert count names more than one expert, however it is
    written (8, 8.0, "8"; a count of 8.0 or "8" passed as none)."""
    if isinstance(value, bool) or value is None:
        return False
    try:
        return float(value) > 1
    except (TypeError, ValueError):
        return False


def _refuse_experts(cfg: Mapping[str, Any]) -> None:
    """UnsupportedArchitecture for a config with more than one expert per layer, whatever
    its ``model_type``: read as its family's dense decoder (a ``llama`` config with
    Mixtral's eight experts was imported as a 7B model), its weights, memory and time
    would be a fraction of the model's. Refused even where only the shape is read."""
    experts = {key: cfg[key] for key in EXPERT_COUNT_KEYS if _more_than_one(cfg.get(key))}
    # One level down too: DBRX gives its count in ``ffn_config`` (a llama config with it
    # imported as a dense model: a tester).
    for name, inner in cfg.items():
        if isinstance(inner, Mapping):
            experts.update(
                (f"{name}.{key}", inner[key])
                for key in EXPERT_COUNT_KEYS
                if _more_than_one(inner.get(key))
            )
    if experts:
        said = ", ".join(f"{key} {value}" for key, value in experts.items())
        raise UnsupportedArchitecture(
            f"a mixture-of-experts config ({said}): iserve reads dense decoders only, and "
            "read as one this model's weights, memory and time would be a fraction of its own"
        )


def config_with_layers(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """A copy of ``cfg`` describing the same model with ``num_layers`` decoder layers.

    Knows each family's name for the layer count (GPT-J's ``n_layer``) and trims or extends
    per-layer lists such as ``layer_types``; used to cut fingerprints and write presets.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    family = family_of(cfg)
    out = dict(cfg)
    keys = [key for key in family.layer_count_keys if key in cfg] or [family.layer_count_keys[0]]
    for key in keys:
        out[key] = num_layers
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        out["layer_types"] = [layer_types[min(i, len(layer_types) - 1)] for i in range(num_layers)]
    return out


def supported_model_types() -> list[str]:
    """The ``model_type`` values :func:`parse_config` accepts."""
    return sorted(t for family in FAMILIES.values() for t in family.model_types)
