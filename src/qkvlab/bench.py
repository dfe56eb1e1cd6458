"""Throughput, cache bytes and capacity per scheme, measured in one run.

- training tokens/s and model FLOPs utilisation against this machine's measured matmul rate;
- decoding with the KV cache, prefill and decode timed apart (qkvlab.decode.speed): prefill tokens/s, ms per
  decode step, decode tokens/s and end-to-end tokens/s, beside `transformers`' `generate` on the same
  weights (its prefill: generate(1)), the two timed alternately in the same run; and the step's
  memory-bandwidth limit (weights + cache read once, at the copy rate measured at the start) with the
  fraction of it reached;
- KV-cache bytes actually allocated by the cache tensors beside the analytic figure;
- capacity: concurrent sequences of the model's context that fit a memory budget;
- the machine's load (qkvlab.base.loadavg) over the whole run and over each variant, with the verdict
  quiet/noisy; `require_quiet` refuses a noisy machine (NoisyMachine: exit 3 from the CLI).

For reduced schemes the transformers model gets the explicit equivalent: an identity role becomes an
identity matrix, a shared projection is duplicated, GQA/MQA heads are repeated, and a non-default
attention scale is folded into W_Q (GPT-2 always scales by 1/sqrt(d_head)).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qkvlab.base.devices import (
    DEVICE_HELP,
    DTYPE_BYTES,
    check_device,
    compile_mode,
    compile_setting,
    dtype_name,
    inference_dtype_setting,
    select_device,
    torch_dtype,
)
from qkvlab.base.errors import UserError
from qkvlab.base.heap import hold_freed_memory
from qkvlab.base.loadavg import LoadWatch, NoisyMachine, fmt, load1
from qkvlab.base.settings import check, seed_setting, setting
from qkvlab.base.units import byte_size
from qkvlab.convert.hf import to_hf
from qkvlab.decode.choices import model_choices
from qkvlab.decode.dtype_probe import autocast_dtype, inference_dtype
from qkvlab.decode.speed import bandwidth_limit_step_s, best_of, time_decode, time_hf
from qkvlab.decode.speed import copy_rate as measured_copy_rate
from qkvlab.model.accounting import analytic_params, flops_per_token, kv_cache_bytes_per_token
from qkvlab.model.cache import KVCache
from qkvlab.model.config import DEFAULT_PRESET, PRESETS, ModelConfig, preset
from qkvlab.model.limits import check_fits, check_model, check_training
from qkvlab.model.transformer import GPT
from qkvlab.model.variants import parse_variants

DEFAULT_VARIANTS = "Q-K-V,Id-K-V,Q-K=V,Q=K=V,Id-K=V,Q-K=V/MQA"


@dataclass
class BenchConfig:
    """What `qkvlab bench` measures; usable as is from Python (`run(BenchConfig(variants="Q-K-V"))`)."""

    variants: str = setting(
        DEFAULT_VARIANTS,
        help="comma-separated variants, SCHEME[/MQA|/GQA-g][/mlp]",
        metavar="LIST",
        flags=("--schemes",),
    )
    preset: str = setting(DEFAULT_PRESET, help="model preset", choices=PRESETS)
    model: dict[str, Any] = setting(help="model options", default_factory=dict, group=ModelConfig)
    batch: int = setting(16, help="sequences in the cache-bytes figure", minimum=1)
    decode_batches: tuple[int, ...] = setting((1, 16), help="decode batch sizes", metavar="LIST", minimum=1)
    prompt_len: int = setting(16, help="prompt tokens per decoded sequence", minimum=1)
    new_tokens: int = setting(32, help="tokens decoded per sequence", minimum=1)
    rounds: int = setting(3, help="alternating timing rounds (the best is reported)", minimum=1)
    train_batch: int = setting(4, help="sequences per training step", minimum=1)
    train_steps: int = setting(3, help="timed training steps (the best is reported)", minimum=1)
    memory_budget: str | None = setting(
        None, help="capacity budget, e.g. 24GB or 80GiB (default: this device's memory)", metavar="SIZE"
    )
    device: str = setting("auto", help=DEVICE_HELP, metavar="DEVICE")
    dtype: str = inference_dtype_setting(
        "weights and cache dtype (auto: bf16 on GPU; on the CPU bf16 where a timed decode step at these shapes "
        "says it is faster, and training's autocast likewise from a timed training step)"
    )
    compile: str = compile_setting(
        "off",
        "decode with the static step under torch.compile with this mode (compiled once per shape; bare "
        "--compile: default; auto: generate's default path on this device)",
    )
    require_quiet: bool = setting(
        False, help="exit 3 if the machine is noisy (qkvlab.base.loadavg) before or during the run"
    )
    hf: bool = setting(True, help="time transformers' generate on the same weights")
    train: bool = setting(True, help="measure training throughput")
    threads: int | None = setting(None, help="torch CPU threads (default: torch's)", minimum=1)
    seed: int = seed_setting(0, help="seed of the weights and prompts")
    json: str | None = setting(None, help="also write the results as JSON to FILE", metavar="FILE")
    compare_dir: str | None = setting(None, help="a qkvlab compare output: plot cache bytes vs quality", metavar="DIR")
    plot: str = setting("cache_vs_quality.png", help="where the plot goes", metavar="FILE")

    def validate(self) -> BenchConfig:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        for key in ("attn", "kv_heads", "match_params"):
            if self.model.get(key) is not None:
                raise UserError(
                    f"--{key.replace('_', '-')} sets one variant; bench takes --variants, e.g. Q-K-V,Q-K=V/MQA"
                )
        if ":" in self.variants:
            raise UserError(f"--variants {self.variants!r}: write key/value heads as /MQA or /GQA-g, e.g. Q-K=V/MQA")
        parse_variants(self.variants)
        if not self.decode_batches:
            raise UserError("decode_batches=(): give at least one batch size")
        check_device(self.device)
        dtype_name(self.dtype)
        self.budget_bytes  # noqa: B018 (checks the size)
        if self.prompt_len >= self.model_config.context:
            raise UserError(
                f"--prompt-len {self.prompt_len} leaves no room to decode in a context of {self.model_config.context}"
            )
        return self

    @property
    def model_config(self) -> ModelConfig:
        return preset(self.preset, **self.model)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else byte_size(self.memory_budget, "--memory-budget")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def variant_configs(cfg: BenchConfig) -> list[tuple[str, ModelConfig]]:
    """[(variant name, model config)] of the benchmark."""
    base = cfg.model_config
    return [(v.name, v.apply(base)) for v in parse_variants(cfg.variants)]


# ---- the transformers twin ---------------------------------------------------------------------
def hf_twin(model: GPT):
    """A transformers model computing the same function on `model`'s weights: GPT-2 (Llama for
    rotary models) from qkvlab.convert.hf's exporter; a UserError names what has no equivalent."""
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
    """Forward + backward + AdamW steps on random tokens at the model's context (`run` holds the CPU
    heap first, as training does)."""
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


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cache_bytes(cfg: ModelConfig, batch: int, dtype: torch.dtype, device) -> int:
    """Bytes held by a real cache at the model's context (allocated, then freed)."""
    cache = KVCache(cfg, batch, cfg.context, device=device, dtype=dtype)
    n = cache.bytes_allocated()
    del cache
    return n


def bench_variant(
    name: str,
    cfg: ModelConfig,
    opts: BenchConfig,
    flops_peak: float,
    device,
    log: Callable[[str], None],
    copy_rate: float,
    dname: str,
) -> dict:
    """One variant's figures. Decoding: prefill and decode steps timed apart (qkvlab.decode.speed), the
    decode path is generate's: the static step, eager or compiled (`compile`); the bandwidth limit of a
    step reads the weights once and each row's cache at its mean fill, at `copy_rate` bytes/s."""
    watch = LoadWatch.start()
    out = cache_figures(cfg, opts, device, dname)
    if opts.train:
        tname, probe = autocast_dtype(opts.dtype, device.type, cfg, opts.train_batch * cfg.context)
        out["train_dtype"] = tname
        if probe is not None:  # what decided "auto" here, with its figures
            out["dtype_probe"] = probe.record()
        tps = train_tokens_per_s(
            cfg, batch=opts.train_batch, steps=opts.train_steps, device=device, dtype=torch_dtype(tname), seed=opts.seed
        )
        out["train_tokens_per_s"] = tps
        out["train_mfu"] = tps * flops_per_token(cfg) / flops_peak
    torch.manual_seed(opts.seed)
    model = GPT(cfg).to(device=device, dtype=torch_dtype(dname)).eval()
    hf = _hf_twin(model, cfg, opts, device, out)
    new = min(opts.new_tokens, cfg.context - opts.prompt_len)
    if new < 1:
        raise UserError(f"--prompt-len {opts.prompt_len} leaves no room to decode in a context of {cfg.context}")
    out |= {"decode_prompt_len": opts.prompt_len, "decode_new_tokens": new}
    out |= decode_figures(name, model, hf, opts, new, copy_rate, log)
    out["load"] = watch.finish().to_dict()
    return out


def cache_figures(cfg: ModelConfig, opts: BenchConfig, device, dname: str) -> dict:
    """KV cache bytes allocated vs analytic, and how many sequences the memory budget holds."""
    per_token = kv_cache_bytes_per_token(cfg, dname)
    weights = analytic_params(cfg).total * DTYPE_BYTES[dname]
    budget = opts.budget_bytes or device_memory(device)
    return {
        "scheme": cfg.spec.name,
        "kv_heads": cfg.n_kv_heads,
        "dtype": dname,
        "context": cfg.context,
        "batch": opts.batch,
        "kv_cache_bytes_allocated": cache_bytes(cfg, opts.batch, torch_dtype(dname), device),
        "kv_cache_bytes_analytic": per_token * opts.batch * cfg.context,
        "kv_cache_bytes_per_token": per_token,
        "memory_budget_bytes": budget,
        "weight_bytes": weights,
        "capacity_sequences": max(0, (budget - weights) // (per_token * cfg.context)),
    }


def _hf_twin(model: GPT, cfg: ModelConfig, opts: BenchConfig, device, out: dict):
    """transformers' model with the same weights (its logit difference recorded), or None with a note."""
    if not opts.hf:
        out["hf_note"] = "skipped (--no-hf)"
        return None
    try:
        hf = hf_twin(model).to(device=device, dtype=next(model.parameters()).dtype)
    except UserError as e:
        out["hf_note"] = str(e)
        return None
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    probe = torch.randint(0, cfg.vocab_size, (2, min(cfg.context, 12)), device=device)
    with torch.inference_mode():
        out["hf_max_logit_diff"] = (hf(probe).logits.float() - model(probe)[0].float()).abs().max().item()
    return hf


def decode_figures(name: str, model: GPT, hf, opts: BenchConfig, new: int, copy_rate: float, log) -> dict:
    """Prefill and decode per batch size, ours and transformers' in alternating rounds."""
    device = next(model.parameters()).device
    mode = compile_mode(opts.compile, device.type)
    path = mode or "eager"  # speed.time_decode takes a torch.compile mode as its path
    out: dict = {"decode_path": "eager" if mode is None else f"compiled {mode}"}
    ours_by_b, hf_by_b = {}, {}
    for b in opts.decode_batches:
        prompt = torch.randint(0, model.cfg.vocab_size, (b, opts.prompt_len), device=device)
        choices = model_choices(model, b)  # the layout generate would decode this batch in
        warm = time_decode(model, prompt, new, path, choices)  # warm up; compiles once per shape (timed)
        if warm.compile_s is not None:
            out.setdefault("compile_seconds_by_batch", {})[str(b)] = warm.compile_s
        if hf is not None:
            time_hf(hf, prompt, 2)
        ours, theirs = [], []
        for _ in range(opts.rounds):  # alternate so drift in machine load hits both alike
            ours.append(time_decode(model, prompt, new, path, choices))
            if hf is not None:
                theirs.append(time_hf(hf, prompt, new))
        t = ours_by_b[str(b)] = best_of(ours)
        if theirs:
            hf_by_b[str(b)] = best_of(theirs)
        limit = bandwidth_limit_step_s(model, b, opts.prompt_len + new / 2, copy_rate)
        out.setdefault("bandwidth_limit_step_ms_by_batch", {})[str(b)] = 1e3 * limit
        out.setdefault("bandwidth_fraction_by_batch", {})[str(b)] = ratio(limit, t.step_s)
        log(
            f"  {name} b={b}: prefill {fmt(t.prefill_tokens_per_s, '.0f')} tok/s, decode {fmt(ms(t.step_s), '.2f')} "
            f"ms/step ({fmt(t.decode_tokens_per_s)} tok/s, {fmt(ratio(limit, t.step_s), '.0%')} of the bandwidth limit)"
            + (f"; transformers {fmt(ms(hf_by_b[str(b)].step_s), '.2f')} ms/step" if theirs else "")
            + f" [load {fmt(load1(), '.2f', '?')}]"
        )
    return out | _by_batch_figures(ours_by_b, hf_by_b, str(opts.decode_batches[0]))


def _by_batch_figures(ours_by_b: dict, hf_by_b: dict, first: str) -> dict:
    def by_batch(timings: dict, attr: str, scale: float = 1.0) -> dict | None:
        return {b: None if getattr(t, attr) is None else scale * getattr(t, attr) for b, t in timings.items()} or None

    out: dict = {}
    for prefix, timings in (("", ours_by_b), ("hf_", hf_by_b)):
        out |= {
            f"{prefix}prefill_tokens_per_s_by_batch": by_batch(timings, "prefill_tokens_per_s"),
            f"{prefix}decode_step_ms_by_batch": by_batch(timings, "step_s", 1e3),
            f"{prefix}decode_tokens_per_s_by_batch": by_batch(timings, "decode_tokens_per_s"),
            f"{prefix}end_to_end_tokens_per_s_by_batch": by_batch(timings, "end_to_end_tokens_per_s"),
            f"{prefix}decode_tokens_per_s": timings[first].decode_tokens_per_s if timings else None,
        }
    if hf_by_b:  # None where either side is unmeasured
        out["decode_speedup_vs_hf"] = {b: ratio(hf_by_b[b].step_s, ours_by_b[b].step_s) for b in hf_by_b}
        out["end_to_end_speedup_vs_hf"] = {
            b: ratio(ours_by_b[b].end_to_end_tokens_per_s, hf_by_b[b].end_to_end_tokens_per_s) for b in hf_by_b
        }
    return out


def check_fits_bench(name: str, cfg: ModelConfig, opts: BenchConfig, device, dname: str) -> None:
    """The variant's weights, its largest KV cache and (if timed) a training step fit `device`."""
    check_model(cfg, f"bench {name}", device, DTYPE_BYTES[dname])
    rows = max(opts.batch, *opts.decode_batches)
    cache = kv_cache_bytes_per_token(cfg, dname) * rows * cfg.context
    check_fits(
        cache, f"bench {name}: a KV cache of {rows} x {cfg.context:,} tokens", "lower --context or --batch", device
    )
    if opts.train:
        check_training(cfg, micro_batch=opts.train_batch, seq_len=cfg.context, device=device)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is unmeasured (None) or b is not positive."""
    return None if a is None or b is None or not b > 0 else a / b


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def run(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    """Measure every variant of `cfg`; a JSON-able dict (device, dtype, matmul rate, per variant)."""
    cfg.validate()
    device = select_device(cfg.device)
    dname = dtype_name(cfg.dtype, device_type=device.type)  # "auto" on the CPU: fp32 here, the larger, until timed
    for name, m in variant_configs(cfg):  # a user error before anything is allocated or printed
        check_fits_bench(name, m, cfg, device, dname)
    watch = LoadWatch.start()  # before any work of ours: the verdict reads the load before it
    log(f"machine before the run: {watch.before_summary()}")
    if cfg.require_quiet and watch.noisy_before:
        raise NoisyMachine(f"noisy machine before starting: {watch.before_summary()} (--require-quiet)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.train and device.type == "cpu":  # as training runs; from the start, so every figure sees one heap
        hold_freed_memory()
    mcfg = cfg.model_config
    tname, probe = autocast_dtype(cfg.dtype, device.type, mcfg, cfg.train_batch * mcfg.context)
    if probe is not None:
        log(probe.describe())
    peak = matmul_flops_per_s(device, torch_dtype(tname))
    rate = measured_copy_rate(device)
    log(f"matmul rate on {device} ({tname}): {peak / 1e9:.1f} GFLOP/s; copy rate {rate / 1e9:.1f} GB/s")
    dname, decode_probe = inference_dtype(cfg.dtype, device.type, mcfg, cfg.decode_batches)
    if decode_probe is not None:  # auto on the CPU: decided by timing a decode step of these shapes
        log(decode_probe.describe())
    results = {name: bench_variant(name, m, cfg, peak, device, log, rate, dname) for name, m in variant_configs(cfg)}
    base = next(iter(results.values()))["kv_cache_bytes_analytic"]
    for r in results.values():
        r["kv_cache_fraction_of_first"] = r["kv_cache_bytes_analytic"] / base
    watch.finish()
    log(f"machine during the run: {watch.summary()}")
    return {
        "load": watch.to_dict(),
        "train_dtype": tname,  # training: fp32 weights under autocast in this dtype (fp32: none)
        "device": str(device),
        "dtype": dname,
        "decode_dtype_probe": None if decode_probe is None else decode_probe.record(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul_flops_per_s": peak,
        "copy_bytes_per_s": rate,
        "options": cfg.to_dict(),
        "schemes": results,
    }
