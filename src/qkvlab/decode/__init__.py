"""Decoding: prefill and decode steps, sampling, and the measured decoding choices (layout, dtype) as values
that callers pass in."""
