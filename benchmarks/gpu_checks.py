"""The GPU's first-day checks in one process, the most valuable first (run by benchmarks/gpu_check.sh).

Each check prints and appends one line to OUT/summary.txt as soon as it ends (PASS/FAIL/SKIP, its
name and its figure), so a run cut short by its budget keeps what it found; OUT/checks.json holds
every check's figures (rewritten after each). A check that raises is a FAIL with the error's first
line; the next check runs anyway.

 1. flash     which SDPA kernel actually ran (profiler) per scheme at head dims 64 and 128, bf16
 2. plus      the "+" term on the flash kernel in bf16 against the explicit fp32 formula
 3. memory    accounting.memory_estimate against max_memory_allocated, gpt2-124m, one training step
 4. mfu       compiled gpt2-124m training: tokens/s and MFU against the measured bf16 matmul rate
 5. fsdp      FSDP2 on a one-rank NCCL group with the bf16 policy, two steps, a DCP save/load round trip
 6. graphs    CUDA-graph decode (reduce-overhead): the same greedy tokens as eager, faster, no re-record

--cpu-dry: tiny shapes on the CPU (gloo for NCCL, eager for compiled), CUDA-only checks as SKIP;
what the test suite runs.

    OUT=out python3 benchmarks/gpu_checks.py            # on the GPU machine (gpu_check.sh does this)
    python3 benchmarks/gpu_checks.py --cpu-dry --out /tmp/dry
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from qkvlab.model.config import ModelConfig, preset
from qkvlab.model.transformer import GPT

SCHEMES = ("Q-K-V", "Id-K-V", "Q=K-V", "Q-K=V", "Q=K=V", "Id-K=V", "(Q=K-V)+", "(Q-K=V)+")


class Skip(Exception):
    """A check that cannot run here (CUDA only under --cpu-dry)."""


class Checks:
    def __init__(self, out: Path, dry: bool):
        self.out, self.dry = out, dry
        self.device = torch.device("cpu" if dry else "cuda", 0 if not dry else None)
        self.results: dict[str, dict] = {}
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.txt").write_text("")

    def run(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            passed, figure, data = fn(self)
            verdict = "PASS" if passed else "FAIL"
        except Skip as e:
            verdict, figure, data = "SKIP", str(e), {}
        except Exception as e:  # noqa: BLE001 - a failed check must not stop the others
            verdict, figure = "FAIL", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            data = {"traceback": traceback.format_exc()[-4000:]}
            print(data["traceback"], flush=True)
        seconds = time.perf_counter() - t0
        line = f"{verdict} {name}: {figure} ({seconds:.0f} s)"
        print(line, flush=True)
        with open(self.out / "summary.txt", "a", encoding="utf-8") as f:
            f.write(line + "\n")
        self.results[name] = {"verdict": verdict, "figure": figure, "seconds": seconds, **data}
        tmp = self.out / "checks.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "checks.json")

    def cuda_only(self, what: str) -> None:
        if self.dry:
            raise Skip(f"{what} needs CUDA (--cpu-dry)")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ---- 1. flash eligibility: the kernel that actually ran --------------------------------------------
def sdpa_kernels(fn) -> set[str]:
    """Names of the SDPA backends (aten ops) and attention kernels that ran in fn()."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    names = {e.name for e in prof.events()}
    keep = ("scaled_dot_product", "flash", "fmha", "cudnn", "efficient_attention")
    return {n for n in names if any(k in n.lower() for k in keep) and "aten::scaled_dot_product_attention" != n}


def check_flash(c: Checks):
    dtype = torch.bfloat16
    ran, missing = {}, []
    for hd in (64, 128):
        for scheme in ("Q-K-V", "(Q=K-V)+") if c.dry else SCHEMES:
            n_head = 1 if c.dry else 8
            cfg = ModelConfig(
                attn=scheme, n_layer=1, n_head=n_head, d_model=n_head * hd, vocab_size=64, context=16 if c.dry else 512
            ).validate()
            model = GPT(cfg).to(c.device)
            x = torch.randint(0, cfg.vocab_size, (2, cfg.context + 1), device=c.device)

            def step():
                with torch.autocast(c.device.type, dtype=dtype):
                    loss = model(x[:, :-1], x[:, 1:])[1]
                loss.backward()
                c.sync()

            names = sdpa_kernels(step)
            ran[f"{scheme} hd{hd}"] = sorted(names)
            if not any("flash" in n.lower() for n in names):
                missing.append(f"{scheme} hd{hd}")
    n = len(ran)
    figure = f"flash ran in {n - len(missing)}/{n} (scheme, head dim)" + (
        f"; not in {', '.join(missing)}" if missing else ""
    )
    return not missing, figure, {"kernels": ran}


# ---- 2. "+" on flash in bf16 vs the fp32 formula ----------------------------------------------------
def check_plus(c: Checks):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qkvlab.model.attention import ride_key_term
    from qkvlab.model.positions import ScoreTerm2D

    B, H, T, hd = (1, 2, 32, 64) if c.dry else (4, 16, 1024, 64)
    torch.manual_seed(0)
    term = ScoreTerm2D(10, T).to(c.device)
    q, k, v = (torch.randn(B, H, T, hd, device=c.device) for _ in range(3))
    pos = torch.arange(T, device=c.device)[None].expand(B, -1)
    scale = hd**-0.5
    a, col = term.row_col_terms(pos, pos)  # the explicit formula, fp32: S sum(w) + a(i) + c(j), causal
    add = (a[:, :, None] + col[:, None, :])[:, None]
    causal = torch.ones(T, T, dtype=torch.bool, device=c.device).tril()
    ref = F.scaled_dot_product_attention(
        q * term.score_scale(), k, v, attn_mask=add.masked_fill(~causal, float("-inf")), scale=scale
    )
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # forced: raises if flash is not eligible
        q2, k2, v2 = ride_key_term(term, *(t.bfloat16() for t in (q, k, v)), pos, scale)
        got = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=scale)[..., :hd]
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    return err < 2e-2, f"max |bf16 flash - fp32 formula| / max |fp32| = {err:.2e} (< 2e-2)", {"relative_error": err}


# ---- 3. memory estimate vs measured ----------------------------------------------------------------
def check_memory(c: Checks):
    c.cuda_only("max_memory_allocated")
    from qkvlab.model.accounting import memory_estimate
    from qkvlab.train.optim import make_optimizer

    cfg, batch = preset("gpt2-124m"), 8
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(c.device)
    base = torch.cuda.memory_allocated(c.device)
    model = GPT(cfg).to(c.device)
    opt = make_optimizer(model, 1e-4, 0.1, (0.9, 0.95), c.device)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), device=c.device)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(c.device) - base
    est = memory_estimate(cfg, micro_batch=batch, world=1, sharding="ddp", dtype="bf16")
    single = est["total"] - est["comm_buffers"]  # one process: no DDP buckets
    ratio = peak / single
    del model, opt, x, loss
    torch.cuda.empty_cache()
    figure = f"measured peak {peak / 2**30:.2f} GiB, estimate {single / 2**30:.2f} GiB, ratio {ratio:.2f} (0.8-1.25)"
    return 0.8 <= ratio <= 1.25, figure, {"peak_bytes": peak, "estimate": est}


# ---- 4. compiled gpt2-124m MFU ----------------------------------------------------------------------
def check_mfu(c: Checks):
    from qkvlab.bench import matmul_flops_per_s
    from qkvlab.model.accounting import flops_per_token
    from qkvlab.train.optim import make_optimizer

    if c.dry:  # tiny, eager: the code path, not a figure
        cfg, batch, steps, dtype = (
            ModelConfig(n_layer=1, n_head=2, d_model=32, vocab_size=64, context=16),
            2,
            2,
            torch.float32,
        )
    else:
        cfg, batch, steps, dtype = preset("gpt2-124m"), 16, 20, torch.bfloat16
    model = GPT(cfg).to(c.device)
    fwd = model if c.dry else torch.compile(model)
    opt = make_optimizer(model, 1e-4, 0.1, (0.9, 0.95), c.device)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), device=c.device)

    def step():
        with torch.autocast(c.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = fwd(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(3):
        step()  # compiles
    c.sync()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    c.sync()
    tps = batch * cfg.context * steps / (time.perf_counter() - t0)
    peak = matmul_flops_per_s(c.device, dtype, seconds=0.05 if c.dry else 0.5)
    mfu = tps * flops_per_token(cfg) / peak
    if c.device.type == "cuda":
        torch.cuda.empty_cache()
    figure = f"{tps:,.0f} tok/s, MFU {mfu:.1%} of the measured {peak / 1e12:.1f} TFLOP/s (compile {compile_s:.0f} s)"
    return (mfu >= 0.3 or c.dry), figure, {"tokens_per_s": tps, "mfu": mfu, "matmul_flops_per_s": peak}


# ---- 5. FSDP2 one rank, bf16 policy, DCP round trip -------------------------------------------------
def check_fsdp(c: Checks):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from qkvlab.train import distributed as D
    from qkvlab.train.optim import make_optimizer

    with tempfile.TemporaryDirectory() as work:
        dist.init_process_group(
            "gloo" if c.dry else "nccl", init_method=f"file://{work}/store", rank=0, world_size=1,
            device_id=None if c.dry else c.device,
        )  # fmt: skip
        try:
            cfg = ModelConfig(attn="(Q=K-V)+", pos="rope", n_layer=2, n_head=4, d_model=64, vocab_size=256, context=64)
            if c.dry:
                cfg = cfg.replace(n_layer=1, n_head=2, d_model=32, context=16)
            env = D.Env(device=c.device)

            def sharded():
                torch.manual_seed(0)
                return D.shard(GPT(cfg.validate()).to(c.device), env, param_dtype=torch.bfloat16)

            model = sharded()
            opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), c.device)
            x = torch.randint(0, cfg.vocab_size, (2, cfg.context + 1), device=c.device)
            for _ in range(2):
                with torch.autocast(c.device.type, dtype=torch.bfloat16):
                    loss = model(x[:, :-1], x[:, 1:])[1]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{work}/dcp")
            fresh = sharded()
            state = {"model": fresh.state_dict()}
            dcp.load(state, checkpoint_id=f"{work}/dcp")
            fresh.load_state_dict(state["model"])
            diff = max(
                (a.full_tensor() - b.full_tensor()).abs().max().item()
                for a, b in zip(model.parameters(), fresh.parameters())
            )
        finally:
            dist.destroy_process_group()
    ok = diff == 0.0 and torch.isfinite(loss).item()
    return (
        ok,
        f"2 bf16-policy steps, loss {loss.item():.3f}; DCP save/load max |diff| {diff:.1e}",
        {"loss": loss.item()},
    )


# ---- 6. CUDA-graph decode ---------------------------------------------------------------------------
def check_graphs(c: Checks):
    c.cuda_only("CUDA graphs")
    import torch._inductor.cudagraph_trees as trees

    from qkvlab.decode.generate import generate
    from qkvlab.decode.sampling import Sampling

    records = [0]
    init = trees.CUDAGraphNode.__init__

    def counted(self, *args, **kwargs):
        records[0] += 1
        init(self, *args, **kwargs)

    cfg = preset("small").replace(attn="Q-K=V", pos="rope")
    torch.manual_seed(0)
    model = GPT(cfg).to(c.device, torch.bfloat16).eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4
    greedy = Sampling(temperature=0)

    def timed(**kw):
        c.sync()
        t0 = time.perf_counter()
        out = generate(model, prompts, 64, greedy, **kw)
        c.sync()
        return out, time.perf_counter() - t0

    eager, _ = timed()
    eager, t_eager = timed()
    graphs, _ = timed(compile="reduce-overhead")  # compiles and records
    trees.CUDAGraphNode.__init__ = counted
    try:
        graphs, t_graphs = timed(compile="reduce-overhead")  # a new cache of the same shape: replays only
    finally:
        trees.CUDAGraphNode.__init__ = init
    same = graphs == eager
    ok = same and t_graphs < t_eager and records[0] == 0
    figure = (
        f"tokens {'equal' if same else 'DIFFER'}; 64 tokens x 4 rows in {t_graphs * 1e3:.0f} ms vs eager "
        f"{t_eager * 1e3:.0f} ms ({t_eager / t_graphs:.2f}x); graph records in the second call: {records[0]}"
    )
    return ok, figure, {"eager_s": t_eager, "graphs_s": t_graphs, "records": records[0]}


CHECKS = [
    ("flash", check_flash),
    ("plus", check_plus),
    ("memory", check_memory),
    ("mfu", check_mfu),
    ("fsdp", check_fsdp),
    ("graphs", check_graphs),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="summary.txt and checks.json go here")
    p.add_argument("--cpu-dry", action="store_true", help="tiny shapes on the CPU; CUDA-only checks SKIP")
    p.add_argument("--only", help="comma-separated check names")
    args = p.parse_args(argv)
    if not args.cpu_dry and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-dry", file=sys.stderr)
        return 2
    c = Checks(Path(args.out), args.cpu_dry)
    info = f"torch {torch.__version__}, " + (torch.cuda.get_device_name(0) if not args.cpu_dry else "cpu (--cpu-dry)")
    print(info, flush=True)
    only = set(args.only.split(",")) if args.only else None
    for name, fn in CHECKS:
        if only is None or name in only:
            c.run(name, fn)
    return 1 if any(r["verdict"] == "FAIL" for r in c.results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
