"""A checkpoint written by transformers' save_pretrained, served as a new user would:
`iserve register`, `iserve deploy MODEL --tp 1 --pp 1` with no token limits, `iserve
generate MODEL TEXT`. The streamed tokens equal transformers' greedy generation from the
same text through AutoTokenizer.

GPT-J-style: 256 positions (shorter than the default 512 + 256 limits), BOS/EOS 50256
beyond its 320-token vocabulary, a byte-level tokenizer.json and no tokenizer_config.json.
Llama: BOS added by the tokenizer.json's post-processor."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.helpers import cli
from tests.parity.transformers_checkpoints import write_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

PROMPT = "A river runs past the old mill"
MAX_TOKENS = 10


def transformers_greedy(directory) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer(PROMPT)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", ["gptj", "llama", "llama-3.1-style"])
def test_cli_defaults_serve_a_transformers_checkpoint_from_text(stack, family):
    model_id = f"hf-{family}"
    directory = write_checkpoint(stack.models_root / model_id, family, seed=7)
    expected = transformers_greedy(directory)

    registered = cli(stack, "register", model_id, model_id, "--skip-profiling", "--json")
    assert registered.returncode == 0, registered.stderr
    deployed = cli(stack, "deploy", model_id, "--tp", "1", "--pp", "1", "--json")
    assert deployed.returncode == 0, deployed.stderr
    deployment = json.loads(deployed.stdout)["deployment"]
    try:
        # The defaults split the 256-position context (GPT-J) rather than refusing it.
        limits = int(deployment["max_input_tokens"]) + int(deployment["max_output_tokens"])
        assert limits <= 256
        out = cli(stack, "generate", model_id, PROMPT, "--max-tokens", str(MAX_TOKENS), "--json")
        assert out.returncode == 0, out.stderr
        events = [json.loads(line) for line in out.stdout.splitlines()]
        tokens = [int(t) for e in events if "delta" in e for t in e["delta"].get("token_ids", [])]
        assert tokens == expected
        final = events[-1]["final"]
        assert int(final["usage"]["prompt_tokens"]) == len(
            transformers.AutoTokenizer.from_pretrained(str(directory))(PROMPT)["input_ids"]
        )
    finally:
        removed = cli(stack, "remove", deployment["deployment_id"])
        assert removed.returncode == 0, removed.stderr


# Llama 2's layout: the template writes BOS, and the tokenizer.json adds one as well.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def test_a_chat_is_the_prompt_transformers_apply_chat_template_makes(stack):
    """A tokenizer saved by transformers keeps its template in chat_template.jinja; the
    gateway renders it, and the prompt is encoded without a second BOS, as
    ``apply_chat_template(tokenize=True)`` encodes it. The reply is transformers' greedy
    continuation of those ids."""
    import httpx
    from tokenizers import Tokenizer

    model_id = "hf-llama-chat"
    directory = write_checkpoint(stack.models_root / model_id, "llama", seed=7)
    saved = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(directory / "tokenizer.json")),
        bos_token="<s>",
        eos_token="</s>",
    )
    saved.chat_template = BOS_TEMPLATE
    saved.save_pretrained(str(directory))
    assert (directory / "chat_template.jinja").exists()
    messages = [{"role": "user", "content": PROMPT}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == 0 and ids[1] != 0  # one BOS
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)

    assert cli(stack, "register", model_id, model_id, "--skip-profiling").returncode == 0
    deployed = cli(stack, "deploy", model_id, "--tp", "1", "--pp", "1", "--json")
    assert deployed.returncode == 0, deployed.stderr
    deployment = json.loads(deployed.stdout)["deployment"]
    try:
        reply = httpx.post(
            f"http://{stack.settings.gateway_address}/v1/chat/completions",
            json={
                "model": model_id,
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["message"]["content"] == expected
    finally:
        removed = cli(stack, "remove", deployment["deployment_id"])
        assert removed.returncode == 0, removed.stderr
