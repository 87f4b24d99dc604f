"""Sampling: penalties, the seeded sampling rule, and the structured-output token mask."""
