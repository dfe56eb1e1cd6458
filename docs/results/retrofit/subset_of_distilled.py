"""The cheapest layers of a distilled all-layer retrofit, alone: the original model with the K lowest-
output-error layers taken from the distilled model (no further training), scored like curves.py.
A run that trained more than the converted layers' attention (--rest-lr, --train all) is scored only
whole (K = its converted layers: the distilled model as it is), since its other weights moved too; so is
a latent run (--kv-latent), whose rank is one setting for every layer.

Run: python docs/results/retrofit/subset_of_distilled.py SOURCE RUN OUT.json K [K ...] [--text NAME=PATH ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from curves import text_tokens  # beside this script (run as a file, its folder is on sys.path)
from safetensors.torch import load_file

from qkvlab.base.files import atomic_write, json_text, labelled_path
from qkvlab.convert.load import load_any
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.retrofit.fit import with_layers
from qkvlab.retrofit.scoring import perplexity
from qkvlab.retrofit.source import load_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("ks", type=int, nargs="+")
    ap.add_argument("--text", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another OUT")
    report = json.loads((args.run / "retrofit.json").read_text())
    src = load_source(args.source)
    model, cfg = src.model.float().eval(), src.cfg
    distilled = load_any(args.run)
    block = report["options"]["block_size"] or min(cfg.context, 256)
    texts = {"heldout": load_file(str(args.run / "tokens.safetensors"))["val"]}
    for item in args.text:
        name, path = labelled_path(item)
        texts[name] = text_tokens(src.encode, path, src.eot_id)
    by_cost = [lf["layer"] for lf in sorted(report["layers"], key=lambda lf: (lf["error"], lf["layer"]))]
    options, whole = report["options"], len(report["converted_layers"])
    whole_only = options.get("train") == "all" or bool(options.get("rest_lr"))
    whole_only |= options.get("kv_latent") is not None  # not a per-layer choice: scored whole too
    if whole_only and set(args.ks) != {whole}:
        raise SystemExit(
            f"{args.run} is a latent run or trained beyond the converted layers' attention: only K = {whole}"
        )
    rows = []
    for k in args.ks:
        layers = sorted(by_cost[:k])
        if whole_only:  # k == whole
            m, m_cfg = distilled.model.float().eval(), distilled.cfg  # the distilled model as it is
        else:
            m, m_cfg = with_layers(model, cfg, distilled.model.float(), distilled.cfg, layers)
        row = {"layers_converted": k, "layers": layers}
        row["cache_fraction"] = kv_cache_bytes_per_token(m_cfg) / kv_cache_bytes_per_token(cfg)
        row.update({n: perplexity(m, t, block=block, max_tokens=args.eval_tokens) for n, t in texts.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
    atomic_write(args.out, json_text({"source": args.source, "run": str(args.run), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
