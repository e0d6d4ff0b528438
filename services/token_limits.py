"""How many sequences, prompt and output tokens a deployment takes: the one rule of the
deployer (``deploy_svc``), of the estimator's workloads and of ``iserve plan``, which
estimates what the deployer would."""

from __future__ import annotations

from services.errors import InvalidArgument

DEFAULT_MAX_INPUT_TOKENS = 512
DEFAULT_MAX_OUTPUT_TOKENS = 256
# The largest batch a deployment (and so an estimate) may hold.
MAX_BATCH_SIZE = 256


def sequence_length(max_input_tokens: int, max_output_tokens: int) -> int:
    """Positions of KV cache a deployment's worker holds per sequence: its prompt limit
    plus its output limit (the engine's ``max_seq_len``)."""
    return max_input_tokens + max_output_tokens


def check_batch_size(batch_size: int, field: str = "batch_size") -> None:
    """InvalidArgument when ``batch_size`` is above MAX_BATCH_SIZE."""
    if batch_size > MAX_BATCH_SIZE:
        raise InvalidArgument(f"{field} must be at most {MAX_BATCH_SIZE}, got {batch_size}")


def check_positions(
    input_tokens: int, output_tokens: int, positions: int, names: str = "input + output tokens"
) -> None:
    """InvalidArgument when prompt plus output tokens exceed the model's ``positions``
    (its context; 0 when unknown, and then nothing is checked)."""
    if positions and input_tokens + output_tokens > positions:
        raise InvalidArgument(
            f"{names} = {input_tokens + output_tokens} exceeds the model's {positions} positions"
        )


def token_limits(max_input_tokens: int, max_output_tokens: int, positions: int) -> tuple[int, int]:
    """(max input, max output) tokens, 0 meaning a default that fits ``positions`` (the
    model's context; 0 when unknown).

    The defaults are DEFAULT_MAX_INPUT_TOKENS and DEFAULT_MAX_OUTPUT_TOKENS where the
    context holds them (the KV cache a deployment reserves grows with their sum, so a
    long context is opted into, not reserved by default). A shorter context is split
    between input and output in the same 2:1 proportion; a limit given alone leaves the
    other what remains, up to its default. InvalidArgument when the limits do not fit.
    """
    max_in, max_out = max_input_tokens, max_output_tokens
    default_in, default_out = DEFAULT_MAX_INPUT_TOKENS, DEFAULT_MAX_OUTPUT_TOKENS
    if not positions:
        return max_in or default_in, max_out or default_out
    if not max_in and not max_out:
        total = min(positions, default_in + default_out)
        max_out = max(1, total * default_out // (default_in + default_out))
        max_in = total - max_out
    elif not max_out:
        max_out = min(default_out, positions - max_in)
    elif not max_in:
        max_in = min(default_in, positions - max_out)
    check_positions(max_in, max_out, positions, "max_input_tokens + max_output_tokens")
    if max_in < 1 or max_out < 1:
        if max_input_tokens or max_output_tokens:
            given = "max_input_tokens" if max_input_tokens else "max_output_tokens"
            other = "output" if max_input_tokens else "input"
            value = max_input_tokens or max_output_tokens
            raise InvalidArgument(
                f"{given} {value} leaves no room for {other} in the model's {positions} positions"
            )
        raise InvalidArgument(f"the model's {positions} positions hold no input and output")
    return max_in, max_out
