"""Mixture-of-experts: routing, the fused decode experts (fp16 and quantized), the grouped GEMMs
on CUDA cores and on tensor cores, and the experts op that picks among them."""
