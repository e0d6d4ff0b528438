"""The gateway's chat prompts equal transformers' ``apply_chat_template``'s.

Each case saves a tokenizer with transformers' own ``save_pretrained`` (which writes the
template to ``chat_template.jinja``, or to ``tokenizer_config.json`` with
``save_jinja_files=False``), loads it back with ``AutoTokenizer``, and compares the text
``apply_chat_template`` renders, and the ids it encodes, with what the gateway renders
from the same directory (``gateway_svc.chat``) and what a worker encodes with
``prompt_has_special_tokens`` (``encode_prompt(..., add_special_tokens=False)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gateway_svc.chat import read_template, render
from services.models.special_tokens import encode_prompt
from tests.parity.transformers_checkpoints import bpe_tokenizer

transformers = pytest.importorskip("transformers")

# Llama 2 / Mistral: the template writes BOS and the tokenizer adds one too.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
CASES = {
    "bos": BOS_TEMPLATE,
    # tojson as templates with tools or JSON content use it: no HTML escapes, keys in order.
    "tojson": "{% for m in messages %}{{ m | tojson }}\n{{ m.get('content') | tojson(indent=2) }}"
    "{% endfor %}",
    # transformers' training-mask tag.
    "generation": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% endif %}{% endfor %}",
    # Content parts looped over, as multimodal-aware templates do.
    "parts": "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    # namespace() and dict(), undefined special tokens, keys whose value was None.
    "helpers": "{% set ns = namespace(n=0) %}{% set d = dict(a=1) %}{% for m in messages %}"
    "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m['role'] }}={{ m.get('content', 'NONE') }}"
    "{% if m.reasoning_content is defined %}({{ m.thinking }}){% endif %}{% endfor %}"
    "{{ d.a }}{% if pad_token is defined %}PAD{% endif %}{% if bos_token is defined %}BOS"
    "{% endif %}",
}
MESSAGES = [
    {"role": "system", "content": "Answer <briefly> & 'plainly' — é ü 日本"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "The river "}, {"type": "text", "text": "runs"}],
    },
    {"role": "assistant", "content": None, "reasoning": "think first", "z": 1, "a": 2},
    {"role": "user", "content": "Serving systems stream tokens."},
]


def _save(directory: Path, template, *, jinja_files: bool = True) -> Path:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe_tokenizer(add_bos=True), bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = template
    fast.save_pretrained(str(directory), save_jinja_files=jinja_files)
    return directory


def _text_parts_joined(messages: list[dict]) -> list[dict]:
    return [
        {**m, "content": "\n".join(p["text"] for p in m["content"])}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]


def test_text_parts_reach_a_template_that_reads_content_as_a_string_as_their_text():
    """OpenAI clients send parts and mean their text: a template that prints
    message['content'] must not print the list's repr into the prompt."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "again"}]}]
    plain = [{"role": "user", "content": "again"}]
    for case in ("helpers", "tojson"):
        assert render(CASES[case], parts, {}) == render(CASES[case], plain, {})
        assert "'type'" not in render(CASES[case], parts, {})
    looped = render(CASES["parts"], MESSAGES[1:2], {})
    assert looped == "<|user|>The river runs<|assistant|>"  # the template joins them itself


def _messages(case: str) -> list[dict]:
    if case in ("bos", "generation"):  # templates that read content as a string
        return [
            {"role": "user", "content": "The river runs"},
            {"role": "assistant", "content": "past the mill"},
            {"role": "user", "content": "Serving systems"},
        ]
    return json.loads(json.dumps(MESSAGES))


@pytest.mark.parametrize("jinja_files", [True, False], ids=["chat_template.jinja", "config"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_text_and_ids_equal_transformers(tmp_path, case, jinja_files):
    directory = _save(tmp_path, CASES[case], jinja_files=jinja_files)
    assert (directory / "chat_template.jinja").exists() == jinja_files
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = _messages(case)

    # Only "parts" loops over content; the others get text parts as one string, joined
    # by newlines, as vLLM gives them (gateway_svc.chat): transformers is handed the same.
    given = messages if case == "parts" else _text_parts_joined(messages)
    expected_text = reference.apply_chat_template(given, tokenize=False, add_generation_prompt=True)
    template, tokens = read_template(directory)
    text = render(template, messages, tokens)
    assert text == expected_text

    expected_ids = reference.apply_chat_template(given, tokenize=True, add_generation_prompt=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "keys"):
        expected_ids = expected_ids["input_ids"]
    file_tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert encode_prompt(file_tokenizer, text, add_special_tokens=False) == list(expected_ids)


def test_a_template_that_writes_bos_gets_one_bos(tmp_path):
    """The case that failed: the tokenizer would add a second <s> to the template's."""
    directory = _save(tmp_path, BOS_TEMPLATE)
    template, tokens = read_template(directory)
    text = render(template, _messages("bos"), tokens)
    file_tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert encode_prompt(file_tokenizer, text, add_special_tokens=False)[:2] != [0, 0]
    assert encode_prompt(file_tokenizer, text)[:2] == [0, 0]  # what a plain prompt gets


def test_named_templates_use_the_default_one(tmp_path):
    templates = {"default": "D{{ messages | length }}", "tool_use": "T{{ messages | length }}"}
    directory = _save(tmp_path, templates)
    assert (directory / "additional_chat_templates" / "tool_use.jinja").exists()
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = _messages("bos")
    expected = reference.apply_chat_template(messages, tokenize=False)
    template, tokens = read_template(directory)
    assert render(template, messages, tokens) == expected == "D3"


def test_the_jinja_file_wins_over_the_config(tmp_path):
    directory = _save(tmp_path, "from the file")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "from the config"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    expected = reference.apply_chat_template(_messages("bos"), tokenize=False)
    template, tokens = read_template(directory)
    assert render(template, _messages("bos"), tokens) == expected == "from the file"
