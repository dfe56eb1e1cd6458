"""vLLM serves qkvlab's MLA export with its MLA backend, on a lent GPU: greedy tokens against qkvlab's, and
vLLM's KV-cache capacity (tokens) for the MLA export beside the original model at the same cache memory.

    OUT=out bash benchmarks/gpu_mla_vllm.sh                      # on the GPU machine (vllm installed there)
    python benchmarks/gpu_mla_vllm.py --out /tmp/dry --dry-run --tiny   # here: every step but vLLM's

Models: --mla DIR (a qkvlab MLA model folder, e.g. a retrofit's OUT) and --original DIR (a qkvlab model
folder or what `qkvlab convert --from-hf` reads), or, by default, random models built here (seeded) with
SmolLM2-135M's shapes: the original (30 layers, d 576, 9 heads, 3 kv heads of 64: 384 cached numbers per
token and layer) and MLA of its retrofit's size (R + P = 128 + 64 = 192, half); --tiny: 2-layer ones. Random
weights suffice for what is measured: the capacity depends on the shapes only, and parity on the layout. (vLLM
runs bf16 here: a retrofit's latent rows are scaled by sqrt(1e-6 / latent_norm_eps) in the export, 1e-5 for
its eps of 1e4, below fp16's smallest normal number; bf16 has fp32's range.)

1. Export: the original with `--to-hf llama` (convert/hf.py), the MLA model with `--to-hf deepseek`
   (convert/hf_deepseek.py), each read back by transformers and compared with qkvlab (fp32 logits).
2. qkvlab's greedy tokens (fp32) from fixed prompt ids (vLLM gets ids: skip_tokenizer_init, no tokenizer).
3. vLLM, one child process per model (a fresh CUDA context each): LLM(folder, --dtype, enforce_eager,
   kv_cache_memory_bytes = --kv-gib where this vLLM has it, else gpu_memory_utilization), greedy from the
   same ids with the chosen token's logprob; its KV capacity (cache blocks x block size), the attention
   backend it chose (its log), its own "GPU KV cache size" line. vLLM's MLA layer caches one row of
   kv_lora_rank + qk_rope_head_dim per token and layer (vllm/model_executor/layers/attention/mla_attention.py:
   head_size = kv_lora_rank + qk_rope_head_dim, num_kv_heads = 1), so the expected ratio is 192 / 384.
4. Per prompt: tokens equal, the equal prefix, at the first difference the rank and gap (qkvlab's logit std)
   of vLLM's token (bf16 against fp32: a near tie there is rounding), and the largest |logprob difference|
   of the chosen tokens where both agree.

OUT gets summary.txt (PASS/FAIL/SKIP lines), vllm_mla.json (every figure) and log.txt (the children's
output); the exported folders go to --work (default: a temporary folder, removed at the end). Without vllm importable (a bare lease has only torch and no network) the vLLM steps SKIP with a line.
--dry-run: steps 1-2 and the plan of step 3 (the child's LLM arguments), no vLLM, no GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qkvlab.convert.hf import quiet, save_hf, to_hf
from qkvlab.convert.hf_deepseek import DEEPSEEK, is_mla, to_deepseek
from qkvlab.convert.llama_cpp import compare, divergence, qkvlab_greedy
from qkvlab.convert.load import load_any
from qkvlab.convert.reparam import logit_diff
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

SMOLLM2 = dict(n_layer=30, n_head=9, kv_heads=3, d_model=576, mlp_hidden=1536, vocab_size=49152, context=2048)
TINY = dict(n_layer=2, n_head=4, kv_heads=2, d_model=64, mlp_hidden=128, vocab_size=512, context=256)
BF16_TIE_STD = 0.05  # a first difference where vLLM (bf16) took qkvlab's (fp32) runner-up this close: rounding
RESULT = "VLLM_RESULT "  # the child's last line: this prefix, then its JSON


def random_models(tiny: bool) -> dict[str, tuple[GPT, ModelConfig]]:
    """The original (Llama-shaped) and its MLA counterpart at half the cache, random and seeded."""
    shape = (TINY if tiny else SMOLLM2) | dict(pos="rope", norm="rmsnorm", mlp="swiglu", rope_theta=100000.0)
    shape |= dict(norm_eps=1e-6, init_std=0.05)
    hd = shape["d_model"] // shape["n_head"]
    half = shape["kv_heads"] * hd  # R + P = half of the original's 2 kv_heads hd
    out = {}
    # the MLA model's latent norm as a retrofit's (eps far above the latent's mean square: a fixed scale), so
    # vLLM also reads the eps folded into the latent's rows (convert/hf_deepseek.py)
    mla = dict(kv_latent=half - hd, rope_dim=hd, latent_norm_eps=1e4)
    for name, extra in (("original", {}), ("mla", mla)):
        cfg = ModelConfig(**shape, **extra).validate()
        torch.manual_seed(0)
        out[name] = (GPT(cfg).eval(), cfg)
    return out


def cache_numbers(cfg: ModelConfig) -> int:
    """Numbers a token caches per layer in vLLM: MLA's one row, else keys and values of every kv head."""
    return cfg.kv_latent + cfg.rope_dim if is_mla(cfg) else 2 * cfg.n_kv_heads * cfg.head_dim


def export(model: GPT, cfg: ModelConfig, folder: Path) -> float:
    """The transformers folder vLLM reads; its logits against qkvlab's (max relative difference, fp32)."""
    from transformers import AutoModelForCausalLM  # optional: transformers

    save_hf(to_deepseek(model, cfg) if is_mla(cfg) else to_hf(model, cfg, "llama"), folder)
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return logit_diff(model, back, cfg.vocab_size, cfg.context, batch=2, length=32)[1]


def llm_kwargs(folder: Path, args, context: int) -> dict:
    """vLLM's LLM(...) arguments: the same cache memory for both models, so capacity reads as tokens admitted."""
    kw = dict(model=str(folder), dtype=args.dtype, skip_tokenizer_init=True, enforce_eager=True, seed=0)
    kw |= dict(max_model_len=min(context, args.max_len), gpu_memory_utilization=args.gpu_util)
    kw["kv_cache_memory_bytes"] = int(args.kv_gib * 2**30)  # dropped by the child where vLLM has no such field
    return kw


def child(spec_file: str) -> int:
    """One model in vLLM (run as its own process): greedy tokens and logprobs from the prompt ids, capacity."""
    from vllm import LLM, SamplingParams  # optional: vllm (the lent GPU's)
    from vllm.engine.arg_utils import EngineArgs  # optional: vllm

    spec = json.loads(Path(spec_file).read_text())
    kw = spec["llm"]
    if "kv_cache_memory_bytes" not in inspect.signature(EngineArgs).parameters:
        kw.pop("kv_cache_memory_bytes")
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["new_tokens"], logprobs=1, ignore_eos=True, detokenize=False
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    outs = llm.generate(prompts, params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, ids)] for o, ids in zip(outs, tokens)]
    cache = llm.llm_engine.vllm_config.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None)
    capacity = None if blocks is None else blocks * cache.block_size
    got = dict(tokens=tokens, logprobs=logprobs, num_gpu_blocks=blocks, block_size=cache.block_size)
    got |= dict(capacity_tokens=capacity, kv_cache_memory_bytes=kw.get("kv_cache_memory_bytes"), start_s=start_s)
    print(RESULT + json.dumps(got), flush=True)
    return 0


def run_vllm(name: str, folder: Path, prompts: list[list[int]], args, context: int, out: Path) -> dict:
    """The child for one model: its result, with the backend and capacity vLLM logged."""
    spec = dict(llm=llm_kwargs(folder, args, context), prompts=prompts, new_tokens=args.new_tokens)
    (folder.parent / f"{name}_spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, __file__, "--vllm-child", str(folder.parent / f"{name}_spec.json")]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    log = got.stdout + got.stderr
    with open(out / "log.txt", "a") as f:
        f.write(f"==== {name}: {' '.join(cmd)}\n{log}\n")
    line = next((x for x in reversed(log.splitlines()) if x.startswith(RESULT)), None)
    if got.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM exited {got.returncode}: {(log.strip().splitlines() or ['?'])[-1][:200]}")
    result = json.loads(line[len(RESULT) :])
    backend = re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", log)
    logged = re.findall(r"GPU KV cache size: ([\d,]+) tokens", log)
    result |= dict(
        backend=backend[-1] if backend else None, logged_kv_tokens=int(logged[-1].replace(",", "")) if logged else None
    )
    return result


def agreement(ours: list[int], logits: torch.Tensor, theirs: list[int], their_lp: list[float]) -> dict:
    got = compare(ours, theirs)
    i = got["first_diff"]
    gap, rank = (None, None) if i is None else divergence(logits[i], ours[i], theirs[i])
    ours_lp = logits.log_softmax(-1)
    n = got["equal_prefix"]
    lp_diff = max((abs(float(ours_lp[j, ours[j]]) - their_lp[j]) for j in range(n)), default=None)
    near = i is None or (rank == 2 and gap < BF16_TIE_STD)
    return got | dict(gap_at_first_diff=gap, rank_of_theirs=rank, agrees=near, max_logprob_diff=lp_diff)


def summary_line(out: Path, verdict: str, name: str, figure: str) -> None:
    line = f"{verdict} {name}: {figure}"
    print(line, flush=True)
    with open(out / "summary.txt", "a") as f:
        f.write(line + "\n")


def load_models(args) -> dict[str, tuple[GPT, ModelConfig]]:
    if args.mla is None:
        return random_models(args.tiny)
    out = {}
    for name, path in (("original", args.original), ("mla", args.mla)):
        loaded = load_any(path)
        out[name] = (loaded.model.float().eval(), loaded.cfg)
    if not is_mla(out["mla"][1]):
        raise SystemExit(f"--mla {args.mla}: {out['mla'][1].scheme_label} is not MLA (--kv-latent R --rope-dim P)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--mla", type=Path, help="a qkvlab MLA model folder (default: random, SmolLM2's shapes)")
    p.add_argument("--original", type=Path, help="the model it came from (with --mla)")
    p.add_argument("--tiny", action="store_true", help="2-layer random models")
    p.add_argument("--dry-run", "--cpu-dry", action="store_true", help="no vLLM: exports, qkvlab's tokens, the plan")
    p.add_argument("--prompts", type=int, default=4, help="random prompts of --prompt-len ids")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("-n", "--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (its MLA backends run fp16/bf16)")
    p.add_argument("--kv-gib", type=float, default=2.0, help="the KV-cache memory both models get")
    p.add_argument("--gpu-util", type=float, default=0.5)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--child-timeout", type=int, default=240)
    p.add_argument("--work", type=Path, help="where the exports go (default: a temporary folder, removed)")
    p.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_child:
        return child(args.vllm_child)
    if (args.mla is None) != (args.original is None):
        p.error("--mla and --original go together")
    if args.work is not None:
        return run(args)
    with tempfile.TemporaryDirectory() as work:  # the exports' weights stay out of OUT
        args.work = Path(work)
        return run(args)


def run(args) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text("")
    quiet()
    models = load_models(args)
    vocab = models["original"][1].vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    have_vllm = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
    report = dict(dry_run=args.dry_run, prompts=len(prompts), new_tokens=args.new_tokens, models={})
    for name, (model, cfg) in models.items():
        folder = args.work / name
        rel = export(model, cfg, folder)
        summary_line(
            out, "PASS" if rel <= 1e-5 else "FAIL", f"export-{name}", f"transformers vs qkvlab fp32 rel {rel:.3g}"
        )
        greedy = [qkvlab_greedy(model, ids, args.new_tokens) for ids in prompts]
        entry = dict(
            scheme=cfg.scheme_label, hf_class=DEEPSEEK if is_mla(cfg) else "llama", transformers_rel_logit_diff=rel
        )
        entry |= dict(cache_numbers_per_token_layer=cache_numbers(cfg), qkvlab_greedy=[ids for ids, _ in greedy])
        entry |= dict(vllm_plan=f"LLM({llm_kwargs(folder, args, cfg.context)})", vllm=None)
        if not args.dry_run and have_vllm:
            try:
                entry["vllm"] = run_vllm(name, folder, prompts, args, cfg.context, out)
                per = [
                    agreement(o, lg, t, lp)
                    for (o, lg), t, lp in zip(greedy, entry["vllm"]["tokens"], entry["vllm"]["logprobs"])
                ]
                entry["agreement"] = per
                ok = all(x["agrees"] for x in per)
                figure = f"{sum(x['equal'] for x in per)} of {sum(x['compared'] for x in per)} greedy tokens equal, backend {entry['vllm']['backend']}"
                summary_line(out, "PASS" if ok else "FAIL", f"vllm-{name}", figure)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                summary_line(out, "FAIL", f"vllm-{name}", str(e).splitlines()[0][:200])
        report["models"][name] = entry
    numbers = [report["models"][k]["cache_numbers_per_token_layer"] for k in ("mla", "original")]
    report["kv_bytes_ratio_expected"] = numbers[0] / numbers[1]
    finish(out, report, args, have_vllm)
    return 0 if "FAIL" not in (out / "summary.txt").read_text() else 1


def finish(out: Path, report: dict, args, have_vllm: bool) -> None:
    """The capacity line (or why there is none) and vllm_mla.json."""
    caps = {
        k: (m["vllm"] or {}).get("capacity_tokens") or (m["vllm"] or {}).get("logged_kv_tokens")
        for k, m in report["models"].items()
    }
    if args.dry_run or not have_vllm:
        why = "--dry-run" if args.dry_run else "vllm not importable or no CUDA device (a bare lease has no network)"
        summary_line(out, "SKIP", "vllm", f"{why}; the plan per model is in vllm_mla.json")
    elif None not in caps.values():
        ratio = caps["mla"] / caps["original"]
        report["capacity_ratio"] = ratio
        figure = f"KV capacity {caps['mla']} tokens (MLA) vs {caps['original']} (original) at {args.kv_gib:g} GiB: x{ratio:.2f}"
        expected = 1 / report["kv_bytes_ratio_expected"]
        summary_line(out, "PASS" if math.isclose(ratio, expected, rel_tol=0.1) else "FAIL", "vllm-capacity", figure)
    (out / "vllm_mla.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
