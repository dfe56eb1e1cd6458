"""Decoding: prefill and decode steps, sampling, and the measured decoding choices (layout, dtype) as values
that callers pass in. One idea a module:

- steps.py: left-padded prompts, prefill, one decode step, the KV cache a decode uses;
- compiled.py: the decode step under torch.compile (warm-up, fallback to eager, guards skipped);
- sampling.py: temperature, top-k, top-p, seeded draws;
- layout.py: the Linear weights' layouts, the decode-time tree that holds them, the layout timed;
- dtype_probe.py: `auto`'s dtype, timed (training's autocast and inference's weights);
- choices.py: `DecodeChoices` (dtype + layout + their measurements), built once by `decode_choices`;
- generate.py: `stream` and `generate`, decoding as the choices say;
- speed.py: decoding timed against the hardware (bench, benchmarks);
- config.py: `qkvlab generate`'s settings;
"""
