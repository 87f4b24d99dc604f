"""Paged attention (decode, prefill, flash prefill, the reference) and what feeds it: rotary, the
KV-cache write, and the fused q/k-norm + rotary + cache write."""
