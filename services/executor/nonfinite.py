"""Non-finite activations: what a request whose logits hold NaN or infinity is told.

The sampler flags such a row (sampler.finite_rows) and the engine ends only that request, with
finish_reason "error" and this message as a 500 error; the executor counts it
(`voltserve:nonfinite_logits_requests_total`). The usual cause is fp16: a checkpoint trained in
bf16 (whose range is fp32's) can hold activations past fp16's largest value, 65504, on some
inputs, and they become infinity, then NaN. `layer_trace.py` finds the first layer where it
happens.
"""

from __future__ import annotations

NONFINITE_STATUS = 500
NONFINITE_TYPE = "internal_server_error"


def nonfinite_message(dtype: str) -> str:
    """The error a request with non-finite logits gets; dtype: the model's torch dtype name."""
    head = "the model's activations became non-finite (NaN or infinity) on this input"
    if dtype.endswith("float16") and not dtype.endswith("bfloat16"):
        return (
            f"{head}: they overflow float16, whose largest value is 65504 (common for checkpoints "
            "trained in bfloat16). The server can run this model with --dtype float32, or "
            "--dtype bfloat16 on a GPU of compute capability 8.0 or newer"
        )
    return f"{head} ({dtype.removeprefix('torch.')}): the checkpoint itself produces them"
