"""Speculative decoding: proposers suggest tokens, one batched target forward verifies them."""
