"""Training throughput: qkvlab's GPT vs nanoGPT's model.py, eager and compiled, in one process.

Contestants (--contestants, NAME[-compiled][@DTYPE]): qkvlab and nanogpt (benchmarks/nanogpt.py, a
faithful reimplementation of nanoGPT's model.py), each eager or under torch.compile, in fp32 or under
bf16 autocast (fp32 master weights, fp32 loss). Every contestant starts from its own seed-0 weights,
takes the same batch, computes its own loss in its own forward and is stepped by its own AdamW
(qkvlab.train.optim.make_optimizer; nanoGPT's configure_optimizers). All are timed alternately,
round after round, best and median of rounds reported as tokens/s, beside each one's FLOPs
utilisation against the dense matmul rate of its dtype measured at the start (qkvlab.bench.
matmul_flops_per_s; FLOPs per token from qkvlab.model.accounting). Ratios are within one run.

The anchor (defaults): L6 H6 D384 T256 V4096 B8, no biases, exact GELU, 2 threads.
Goals (issue 18): qkvlab (eager or compiled, the faster) >= 1.0x nanogpt-compiled in fp32 and >= 90%
of the fp32 matmul rate; where the CPU has native bf16 (qkvlab.base.devices.cpu_has_bf16) qkvlab@bf16 >= 2x
qkvlab fp32 and >= 2x nanogpt fp32 eager (added to the default contestants there).

With --schemes, a regression check across schemes instead: qkvlab's tokens/s per scheme, timed
alternately, as a ratio to the first scheme's (Q-K-V) beside the ideal ratio of their FLOPs per token;
exits 1 when a scheme reaches less than --min-of-ideal of its ideal.

On the CPU the heap holds freed memory, as qkvlab's training sets it (qkvlab.base.heap: no page faults
for a step's fresh tensors), for every contestant alike (--heap glibc: its defaults). The ceiling
line: this model's matmuls and attention timed alone at its shapes, what a step reaches with every
other op free; the fp32 goal is read against it.

Every figure carries the 1-min load; the run's verdict (qkvlab.base.loadavg) comes last; --require-quiet
exits 3 on a noisy machine; --json FILE writes the figures and the load.

    python benchmarks/train_throughput.py --threads 2                       # the anchor, fp32
    python benchmarks/train_throughput.py --threads 2 --schemes Q-K-V,Id-K-V,Q-K=V,Q=K=V   # regression check
    python benchmarks/train_throughput.py --preset gpt2-124m --batch 12 --contestants qkvlab-compiled@bf16,nanogpt-compiled@bf16
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from dataclasses import dataclass

import torch

import nanogpt
from qkvlab.base.devices import cpu_has_bf16, torch_dtype
from qkvlab.base.flag_values import positive_int
from qkvlab.base.heap import hold_freed_memory
from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.bench import matmul_flops_per_s, timed
from qkvlab.model.accounting import flops_per_token
from qkvlab.model.config import ModelConfig, preset
from qkvlab.model.transformer import GPT
from qkvlab.train.optim import make_optimizer

LR, WEIGHT_DECAY, BETAS = 1e-4, 0.1, (0.9, 0.95)


@dataclass
class Contestant:
    name: str  # as given, e.g. qkvlab-compiled@bf16
    family: str  # qkvlab | nanogpt
    compiled: bool
    dtype: str  # fp32 | bf16


def parse_contestants(text: str, default_dtype: str) -> list[Contestant]:
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        body, _, dtype = item.partition("@")
        family, _, mode = body.partition("-")
        if family not in ("qkvlab", "nanogpt") or mode not in ("", "compiled") or dtype not in ("", "fp32", "bf16"):
            raise SystemExit(f"--contestants: {item!r} is not NAME[-compiled][@fp32|@bf16], NAME qkvlab or nanogpt")
        out.append(Contestant(item, family, mode == "compiled", dtype or default_dtype))
    return out


def nanogpt_twin(cfg: ModelConfig) -> nanogpt.GPT:
    conf = nanogpt.GPTConfig(cfg.context, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.dropout, cfg.bias)
    return nanogpt.GPT(conf)


def make_step(c: Contestant, cfg: ModelConfig, x, y, device):
    """One training step of contestant `c` (built here from seed 0): forward with targets, backward, AdamW."""
    torch.manual_seed(0)
    if c.family == "qkvlab":
        model = GPT(cfg).to(device)
        opt = make_optimizer(model, LR, WEIGHT_DECAY, BETAS, device)
    else:
        model = nanogpt_twin(cfg).to(device)
        opt = model.configure_optimizers(WEIGHT_DECAY, LR, BETAS, device.type)
    fwd = torch.compile(model) if c.compiled else model
    dtype = torch_dtype(c.dtype)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with amp:
            _, loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def anchor_config(args) -> ModelConfig:
    if args.preset:
        return preset(args.preset, bias=args.bias)
    return ModelConfig(
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        context=args.context,
        vocab_size=args.vocab_size,
        bias=args.bias,
        mlp="gelu",  # nanoGPT's nn.GELU(): exact
    ).validate()


def race(args, cfg: ModelConfig, device, run: ScriptRun) -> dict:
    default_dtype = "bf16" if device.type == "cuda" else "fp32"
    contestants = parse_contestants(args.contestants, args.dtype or default_dtype)
    if device.type == "cpu" and cpu_has_bf16() and args.contestants == DEFAULT_CONTESTANTS and not args.dtype:
        contestants.append(Contestant("qkvlab@bf16", "qkvlab", False, "bf16"))  # where bf16 could pay
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context + 1), device=device)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    steps = {c.name: make_step(c, cfg, x, y, device) for c in contestants}
    peaks = {d: matmul_flops_per_s(device, torch_dtype(d)) for d in sorted({c.dtype for c in contestants})}
    fpt = flops_per_token(cfg)
    tokens = args.batch * cfg.context
    print(
        f"{device.type} threads={torch.get_num_threads()} | {cfg.n_layer}L d{cfg.d_model} {cfg.n_head}h T{cfg.context} "
        f"V{cfg.vocab_size} B{args.batch} bias={cfg.bias} | matmul "
        + ", ".join(f"{d} {p / 1e9:.1f} GFLOP/s" for d, p in peaks.items())
        + f" | best and median of {args.rounds} alternating rounds x {args.steps} steps  {run.tag()}",
        flush=True,
    )
    for fn in steps.values():  # warm up (and compile)
        fn(), fn()
    rates: dict[str, list[float]] = {k: [] for k in steps}
    faults = dict.fromkeys(steps, 0)
    for _ in range(args.rounds):  # load drifts: every contestant once per round
        for name, fn in steps.items():
            before = page_faults()
            dt = timed(lambda fn=fn: [fn() for _ in range(args.steps)], device)
            faults[name] += page_faults() - before
            rates[name].append(tokens * args.steps / dt)
    best = {k: max(v) for k, v in rates.items()}  # contention only slows a round down
    # MFU's denominator: the faster of before and after the rounds (one 0.5 s reading varies ~10%)
    peaks = {d: max(p, matmul_flops_per_s(device, torch_dtype(d))) for d, p in peaks.items()}
    print(
        "  matmul rate, the faster of before and after: "
        + ", ".join(f"{d} {p / 1e9:.1f} GFLOP/s" for d, p in peaks.items())
    )
    figures = {"contestants": {}, "matmul_flops_per_s": peaks, "flops_per_token": fpt}
    for c in contestants:
        mfu = best[c.name] * fpt / peaks[c.dtype]
        figures["contestants"][c.name] = dict(
            dtype=c.dtype,
            compiled=c.compiled,
            best_tokens_per_s=best[c.name],
            rounds=rates[c.name],
            mfu=mfu,
            page_faults_per_step=faults[c.name] / (args.rounds * args.steps),
        )
        print(
            f"  {c.name:>22}: best {best[c.name]:9,.0f} tok/s, median {statistics.median(rates[c.name]):9,.0f}  "
            f"{mfu:6.1%} of the {c.dtype} matmul rate  {run.tag()}"
        )
    figures["ratios"] = ratios(contestants, best, run)
    if args.profile:
        profile_step(steps[contestants[0].name], contestants[0].name, args.steps)
    if "fp32" in peaks and args.ceiling:
        figures["ceiling"] = ceiling(cfg, args.batch, device, peaks["fp32"], args.rounds, run)
    return figures


def profile_step(step, name: str, steps: int) -> None:
    """torch.profiler's 15 costliest ops (self time, ms a step, its overhead included) of `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    print(f"  {name}, torch.profiler, ms a step (self time; the profiler's overhead included):")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]:
        print(f"    {e.self_cpu_time_total / 1e3 / steps:8.1f}  {e.count // steps:4d} calls  {e.key}")


def page_faults() -> int:
    """This process's minor page faults so far (pages the kernel mapped in and zeroed for it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def ceiling(cfg: ModelConfig, batch: int, device, peak: float, rounds: int, run: ScriptRun) -> dict:
    """The most an fp32 step of this model can reach: its matmuls (forward, grad of input, grad of
    weight for every Linear, each with its own weight) and its attention (SDPA forward and backward,
    causal) timed alone at the model's shapes, every other op free. Activations are shared between
    layers, so they sit warmer in cache than in a real step: an upper bound."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    M = batch * cfg.context
    acts = {n: torch.randn(M, n, device=device) for n in {d for w in weights for d in w.shape}}
    B, H, T, hd = batch, cfg.n_head, cfg.context, cfg.head_dim
    qkv = [torch.randn(B, H, T, hd, device=device, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(B, H, T, hd, device=device)

    def matmuls():
        for w in weights:  # (out, in)
            x, g = acts[w.shape[1]], acts[w.shape[0]]
            x @ w.t(), g @ w, g.t() @ x

    def attention():
        for _ in range(cfg.n_layer):
            out = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)
            torch.autograd.grad(out, qkv, grad_out)

    matmuls(), attention()  # warm up
    mm_s = min(timed(matmuls, device) for _ in range(rounds))
    attn_s = min(timed(attention, device) for _ in range(rounds))
    mfu = M * flops_per_token(cfg) / (mm_s + attn_s) / peak
    print(
        f"  ceiling (fp32): matmuls {mm_s * 1e3:.1f} ms + attention {attn_s * 1e3:.1f} ms a step, alone at "
        f"this model's shapes -> {M / (mm_s + attn_s):,.0f} tok/s, {mfu:.1%} of the fp32 matmul rate  {run.tag()}"
    )
    return dict(matmul_s=mm_s, attention_s=attn_s, tokens_per_s=M / (mm_s + attn_s), mfu=mfu)


def ratios(contestants: list[Contestant], best: dict[str, float], run: ScriptRun) -> dict[str, float]:
    """qkvlab's faster fp32 path against each nanogpt contestant; bf16 qkvlab against the fp32 ones."""
    out = {}
    ours = [c for c in contestants if c.family == "qkvlab" and c.dtype == "fp32"]
    lead = max(ours, key=lambda c: best[c.name], default=None)
    for c in contestants:
        if lead is not None and c.family == "nanogpt":
            out[f"{lead.name} / {c.name}"] = best[lead.name] / best[c.name]
        if c.family == "qkvlab" and c.dtype == "bf16":
            out |= {f"{c.name} / {o.name}": best[c.name] / best[o.name] for o in contestants if o.dtype == "fp32"}
    for k, v in out.items():
        print(f"  {k}: {v:.3f}x  {run.tag()}")
    return out


def across_schemes(args, cfg: ModelConfig, device, run: ScriptRun) -> tuple[int, dict]:
    """tokens/s per scheme vs the first, beside the FLOP ideal; 1 if any falls below --min-of-ideal."""
    schemes = [t.strip() for t in args.schemes.split(",") if t.strip()]
    cfgs = {s: cfg.replace(attn=s).validate() for s in schemes}
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context + 1), device=device)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    steps = {}
    for s, c in cfgs.items():
        steps[s] = make_step(Contestant(s, "qkvlab", args.compile, dtype), c, x, y, device)
        steps[s](), steps[s]()  # warm up (and compile)
    rates: dict[str, list[float]] = {s: [] for s in steps}
    for _ in range(args.rounds):
        for s, fn in steps.items():
            dt = timed(lambda fn=fn: [fn() for _ in range(args.steps)], device)
            rates[s].append(args.batch * cfg.context * args.steps / dt)
    print(
        f"{device.type} {dtype} threads={torch.get_num_threads()} | {cfg.n_layer}L d{cfg.d_model} {cfg.n_head}h "
        f"T{cfg.context} V{cfg.vocab_size} B{args.batch} | best of {args.rounds} alternating rounds"
    )
    first = schemes[0]
    best = {s: max(v) for s, v in rates.items()}  # contention only slows a round down
    failed, figures = [], {}
    for s in schemes:
        ratio = best[s] / best[first]
        ideal = flops_per_token(cfgs[first]) / flops_per_token(cfgs[s])
        ok = ratio >= args.min_of_ideal * ideal
        failed += [] if ok else [s]
        figures[s] = dict(best_tokens_per_s=best[s], ratio=ratio, ideal=ideal, dtype=dtype)
        print(
            f"  {s:>10}: {best[s]:10,.0f} tokens/s  {ratio:.3f}x {first} (FLOP ideal {ideal:.3f}x, "
            f"{ratio / ideal:.0%} of it){'' if ok else '  BELOW ' + format(args.min_of_ideal, '.0%')}  {run.tag()}"
        )
    return (1 if failed else 0), {"schemes": figures}


DEFAULT_CONTESTANTS = "qkvlab,qkvlab-compiled,nanogpt,nanogpt-compiled"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="a qkvlab preset instead of the anchor shape (e.g. gpt2-124m on a GPU)")
    p.add_argument("--n-layer", type=positive_int, default=6)
    p.add_argument("--n-head", type=positive_int, default=6)
    p.add_argument("--d-model", type=positive_int, default=384)
    p.add_argument("--context", type=positive_int, default=256)
    p.add_argument("--vocab-size", type=positive_int, default=4096)
    p.add_argument(
        "--bias", action="store_true", help="biases in linears and norms (nanoGPT's default; not the anchor)"
    )
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per contestant per round")
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--dtype", choices=["fp32", "bf16"], help="contestants without @DTYPE (default fp32 on CPU, bf16 on CUDA)"
    )
    p.add_argument("--contestants", default=DEFAULT_CONTESTANTS, help="NAME[-compiled][@fp32|@bf16], comma-separated")
    p.add_argument("--compile", action="store_true", help="--schemes: compile every scheme")
    p.add_argument("--schemes", help="comma-separated schemes: the regression check across schemes")
    p.add_argument("--min-of-ideal", type=float, default=0.9, help="regression threshold (fraction of FLOP ideal)")
    p.add_argument(
        "--heap",
        choices=["hold", "glibc"],
        default="hold",
        help="hold: the heap keeps freed memory, as qkvlab's CPU training sets it (qkvlab.base.heap; for every "
        "contestant, it is process-wide); glibc: its defaults (run both, alternately, to price it)",
    )
    p.add_argument("--profile", action="store_true", help="after the rounds: the first contestant's costliest ops")
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True, help="time the fp32 ceiling line")
    add_options(p)
    args = p.parse_args()
    run = ScriptRun(args, "train_throughput")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.heap == "hold":
        hold_freed_memory()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = anchor_config(args)
    if args.schemes:
        code, figures = across_schemes(args, cfg, device, run)
    else:
        code, figures = 0, race(args, cfg, device, run)
    sys.exit(run.finish(figures) or code)


if __name__ == "__main__":
    main()
