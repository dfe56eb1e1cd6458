"""Throughput, cache bytes and capacity per scheme, measured in one run.

- training tokens/s and model FLOPs utilisation against this machine's measured matmul rate;
- decoding tokens/s (prefill + greedy decode with the KV cache) beside `transformers`' GPT-2
  `generate` on the same weights, the two timed alternately in the same run;
- KV-cache bytes actually allocated by the cache tensors beside the analytic figure;
- capacity: concurrent sequences of the model's context that fit a memory budget.

For reduced schemes the transformers model gets the explicit equivalent: an identity role becomes an
identity matrix, a shared projection is duplicated, GQA/MQA heads are repeated, and a non-default
attention scale is folded into W_Q (GPT-2 always scales by 1/sqrt(d_head)).
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qkvlab.accounting import analytic_params, flops_per_token, kv_cache_bytes_per_token
from qkvlab.cache import KVCache
from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.generate import Sampling, stream
from qkvlab.model import GPT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- scheme lists -------------------------------------------------------------------------------
def parse_scheme_list(text: str, cfg: ModelConfig) -> list[tuple[str, ModelConfig]]:
    """'Q-K-V,Q-K=V,Q-K=V:kv1' -> [(label, config)]; ':kvN' sets kv_heads (':mqa' = 1)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        scheme, _, heads = item.partition(":")
        kv = None
        if heads:
            h = heads.lower()
            if h == "mqa":
                kv = 1
            elif h.startswith("kv") and h[2:].isdigit() and int(h[2:]) > 0:
                kv = int(h[2:])
            else:
                raise UserError(f"scheme entry {item!r}: after ':' write kvN (N key/value heads) or mqa")
        c = ModelConfig.from_dict({**cfg.to_dict(), "attn": scheme, "kv_heads": kv if kv is not None else cfg.kv_heads})
        out.append((label(c), c))
    if not out:
        raise UserError(f"--schemes {text!r} names no scheme; e.g. Q-K-V,Q-K=V,Q-K=V:mqa")
    return out


def label(cfg: ModelConfig) -> str:
    kv = cfg.n_kv_heads
    if kv == cfg.n_head:
        return cfg.spec.name
    return f"{cfg.spec.name}+{'MQA' if kv == 1 else f'GQA-{kv}'}"


# ---- the transformers twin ---------------------------------------------------------------------
def hf_twin(model: GPT):
    """A transformers model computing the same function on `model`'s weights: GPT-2 (Llama for
    rotary models) from qkvlab.convert.hf's exporter; a UserError names what has no equivalent."""
    from qkvlab.convert.hf import to_hf

    hf = to_hf(model, model.cfg, "llama" if model.cfg.pos == "rope" else "gpt2").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


# ---- measurements --------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """This machine's dense matmul rate (the denominator of MFU)."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm up
    reps, best = 1, float("inf")
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        dt = timed(lambda: [a @ b for _ in range(reps)], device) / reps
        best = min(best, dt)
        reps = min(reps * 2, 64)
    return 2 * n**3 / best


def train_tokens_per_s(cfg: ModelConfig, *, batch: int, steps: int, device, dtype, seed: int = 0) -> float:
    """Forward + backward + AdamW steps on random tokens at the model's context."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), device=device)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with amp:
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm up
    best = min(timed(step, device) for _ in range(steps))
    return batch * cfg.context / best


def decode_seconds(model: GPT, prompt: torch.Tensor, new_tokens: int, compile: bool = False) -> float:
    """Prefill + greedy decode of `new_tokens` per row with qkvlab's cache."""
    device = prompt.device
    prompts = prompt.tolist()
    return timed(
        lambda: sum(1 for _ in stream(model, prompts, new_tokens, Sampling(temperature=0.0), compile=compile)), device
    )


def hf_decode_seconds(hf, prompt: torch.Tensor, new_tokens: int) -> float:
    device = prompt.device
    mask = torch.ones_like(prompt)

    def run():
        with torch.inference_mode():
            hf.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
            )

    return timed(run, device)


@dataclass
class BenchOptions:
    batch: int = 16  # sequences in the cache-bytes figure
    decode_batches: tuple[int, ...] = (1, 16)
    prompt_len: int = 16
    new_tokens: int = 32
    rounds: int = 3
    train_batch: int = 4
    train_steps: int = 3
    memory_budget: int | None = None  # bytes; None: this device's memory
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    hf: bool = True
    train: bool = True
    seed: int = 0
    log: Callable[[str], None] = field(default=lambda s: None)

    def resolve(self) -> tuple[torch.device, torch.dtype, str]:
        dev = torch.device(
            "cuda"
            if self.device == "auto" and torch.cuda.is_available()
            else ("cpu" if self.device == "auto" else self.device)
        )
        name = self.dtype if self.dtype != "auto" else ("bf16" if dev.type == "cuda" else "fp32")
        if name not in DTYPES:
            raise UserError(f"dtype={name!r} is not allowed; use one of {', '.join(DTYPES)} or auto")
        return dev, DTYPES[name], name


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cache_bytes(cfg: ModelConfig, batch: int, dtype: torch.dtype, device) -> int:
    """Bytes held by a real cache at the model's context (allocated, then freed)."""
    cache = KVCache(cfg, batch, cfg.context, device=device, dtype=dtype)
    n = cache.bytes_allocated()
    del cache
    return n


def bench_scheme(cfg: ModelConfig, opts: BenchOptions, flops_peak: float) -> dict:
    device, dtype, dname = opts.resolve()
    per_token = kv_cache_bytes_per_token(cfg, dname)
    out: dict = {
        "scheme": cfg.spec.name,
        "kv_heads": cfg.n_kv_heads,
        "dtype": dname,
        "context": cfg.context,
        "batch": opts.batch,
        "kv_cache_bytes_allocated": cache_bytes(cfg, opts.batch, dtype, device),
        "kv_cache_bytes_analytic": per_token * opts.batch * cfg.context,
        "kv_cache_bytes_per_token": per_token,
    }
    weights = analytic_params(cfg).total * DTYPES[dname].itemsize
    budget = opts.memory_budget if opts.memory_budget is not None else device_memory(device)
    out |= {
        "memory_budget_bytes": budget,
        "weight_bytes": weights,
        "capacity_sequences": max(0, (budget - weights) // (per_token * cfg.context)),
    }
    if opts.train:
        tps = train_tokens_per_s(
            cfg, batch=opts.train_batch, steps=opts.train_steps, device=device, dtype=dtype, seed=opts.seed
        )
        out["train_tokens_per_s"] = tps
        out["train_mfu"] = tps * flops_per_token(cfg) / flops_peak
    torch.manual_seed(opts.seed)
    model = GPT(cfg).to(device=device, dtype=dtype).eval()
    hf = None
    if opts.hf:
        try:
            hf = hf_twin(model).to(device=device, dtype=dtype)
        except UserError as e:
            out["hf_note"] = str(e)
    else:
        out["hf_note"] = "skipped (--no-hf)"
    if hf is not None:
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        probe = torch.randint(0, cfg.vocab_size, (2, min(cfg.context, 12)), device=device)
        with torch.inference_mode():
            out["hf_max_logit_diff"] = (hf(probe).logits.float() - model(probe)[0].float()).abs().max().item()
    new = min(opts.new_tokens, cfg.context - opts.prompt_len)
    if new < 1:
        raise UserError(f"--prompt-len {opts.prompt_len} leaves no room to decode in a context of {cfg.context}")
    ours_by_b, hf_by_b = {}, {}
    for b in opts.decode_batches:
        prompt = torch.randint(0, cfg.vocab_size, (b, opts.prompt_len), device=device)
        decode_seconds(model, prompt, 2, opts.compile)  # warm up (and compile)
        if hf is not None:
            hf_decode_seconds(hf, prompt, 2)
        ours, theirs = [], []
        for _ in range(opts.rounds):  # alternate so drift in machine load hits both alike
            ours.append(decode_seconds(model, prompt, new, opts.compile))
            if hf is not None:
                theirs.append(hf_decode_seconds(hf, prompt, new))
        ours_by_b[str(b)] = b * new / min(ours)
        if theirs:
            hf_by_b[str(b)] = b * new / min(theirs)
        opts.log(
            f"  {label(cfg)} decode b={b}: {ours_by_b[str(b)]:.1f} tok/s"
            + (f" (transformers {hf_by_b[str(b)]:.1f})" if theirs else "")
        )
    first = str(opts.decode_batches[0])
    out |= {
        "decode_prompt_len": opts.prompt_len,
        "decode_new_tokens": new,
        "decode_tokens_per_s": ours_by_b[first],
        "decode_tokens_per_s_by_batch": ours_by_b,
        "hf_decode_tokens_per_s": hf_by_b.get(first),
        "hf_decode_tokens_per_s_by_batch": hf_by_b or None,
    }
    if hf_by_b:
        out["decode_speedup_vs_hf"] = {b: ours_by_b[b] / hf_by_b[b] for b in hf_by_b}
    return out


def run_bench(schemes: list[tuple[str, ModelConfig]], opts: BenchOptions) -> dict:
    device, dtype, dname = opts.resolve()
    peak = matmul_flops_per_s(device, dtype)
    opts.log(f"matmul rate on {device} ({dname}): {peak / 1e9:.1f} GFLOP/s")
    results = {}
    for name, cfg in schemes:
        results[name] = bench_scheme(cfg, opts, peak)
    base = next(iter(results.values()))["kv_cache_bytes_analytic"]
    for r in results.values():
        r["kv_cache_fraction_of_first"] = r["kv_cache_bytes_analytic"] / base
    return {
        "device": str(device),
        "dtype": dname,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul_flops_per_s": peak,
        "options": {k: v for k, v in vars(opts).items() if k != "log"},
        "schemes": results,
    }


# ---- cache bytes vs quality ------------------------------------------------------------------------
def plot_cache_vs_quality(compare_dir: str | Path, out_file: str | Path) -> Path:
    """Scatter of KV-cache bytes/token against validation loss from a compare run's results.csv."""
    path = Path(compare_dir) / "results.csv"
    if not path.is_file():
        raise UserError(f"{compare_dir}: no results.csv (expected the output folder of qkvlab compare)")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = ("variant", "kv_cache_bytes_per_token", "val_loss_mean")
    missing = [c for c in need if not rows or c not in rows[0]]
    if missing:
        raise UserError(f"{path}: column {missing[0]!r} missing (needs {', '.join(need)})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        x, y = float(r["kv_cache_bytes_per_token"]), float(r["val_loss_mean"])
        ax.scatter(x, y)
        change = r.get("ppl_change_pct")
        note = f" ({float(change):+.1f}%)" if change not in (None, "") else ""
        ax.annotate(r["variant"] + note, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes per token")
    ax.set_ylabel("validation loss")
    ax.set_title("cache bytes vs quality")
    fig.tight_layout()
    out_file = Path(out_file)
    fig.savefig(out_file, dpi=120)
    plt.close(fig)
    return out_file
