"""Greedy continuations of curves.py's prompts by a source model and a retrofit of it, side by side (markdown).

Run: python docs/results/retrofit/side_by_side.py SOURCE RUN [NEW_TOKENS]  (SOURCE: what the retrofit read; RUN:
its OUT; fp32, greedy, the source's tokenizer; samples.md on stdout)
"""

from __future__ import annotations

import sys

from curves import PROMPTS  # beside this script

from qkvlab.convert.load import load_any
from qkvlab.decode.generate import generate
from qkvlab.decode.sampling import Sampling

if __name__ == "__main__":
    src, run = load_any(sys.argv[1]), load_any(sys.argv[2])
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    tok = src.tokenizer
    print(f"# Greedy continuations, {new} tokens: {src.cfg.scheme_label} and {run.cfg.scheme_label} ({sys.argv[2]})\n")
    print("`python docs/results/retrofit/side_by_side.py SOURCE RUN`, fp32, greedy.\n")
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        print(f"**{p}**\n")
        for name, m in (("original", src.model), ("retrofit", run.model)):
            out = generate(m.float().eval(), [ids], new, Sampling(temperature=0))[0]
            print(f"- {name}: {tok.decode(out)!r}")
        print()
