"""VOLTSERVE_LAYER_TRACE=1: find the first layer whose output is not finite.

A debugging mode for a checkpoint whose requests end with "non-finite activations" errors.
Forward hooks check the embedding, the residual stream after every decoder layer (its MLP output
plus its residual, as the next layer adds them), the final norm and the logits, in fp32, and log
the first that holds NaN or infinity, or a value past what the model's dtype holds (65504 for
fp16: the next add turns it into infinity), once per forward. Each check waits for the device,
so the executor runs slowly and without CUDA graphs (hooks do not run in a graph replay).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV = "VOLTSERVE_LAYER_TRACE"


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


class LayerTrace:
    def __init__(self, model: Any) -> None:
        inner = model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.limit = torch.finfo(self.dtype).max
        self.reported = False  # this forward's first non-finite output was logged
        inner.embed_tokens.register_forward_hook(self._embedding)
        for i, layer in enumerate(inner.layers):
            layer.register_forward_hook(functools.partial(self._layer, i, len(inner.layers)))
        inner.norm.register_forward_hook(
            lambda _m, _a, out: self.check("the final norm's output", out)
        )
        model.register_forward_hook(lambda _m, _a, out: self.check("the logits", out))

    def _embedding(self, _module: Any, _args: Any, out: torch.Tensor) -> None:
        self.reported = False  # a new forward starts here
        self.check("the embedding's output", out)

    def _layer(self, i: int, n: int, _module: Any, _args: Any, out: tuple) -> None:
        x, residual = out
        self.check(f"the output of layer {i} of {n} (model.layers.{i})", x.float() + residual)

    def check(self, where: str, h: torch.Tensor) -> None:
        if self.reported:
            return
        h = h.float()
        finite = torch.isfinite(h)
        bad_rows = int((~finite.all(-1) | (h.abs() > self.limit).any(-1)).sum())
        if not bad_rows:
            return
        self.reported = True
        largest = float(h[finite].abs().max()) if bool(finite.any()) else float("nan")
        logger.warning(
            "layer trace: %s is not finite in %s for %d of %d token rows (largest finite "
            "|value| %.6g; %s holds up to %.6g)",
            where,
            str(self.dtype).removeprefix("torch."),
            bad_rows,
            h.shape[0],
            largest,
            str(self.dtype).removeprefix("torch."),
            self.limit,
        )


def install(model: Any) -> LayerTrace:
    logger.warning("%s is set: checking every layer's output (slow; no CUDA graphs)", ENV)
    return LayerTrace(model)
