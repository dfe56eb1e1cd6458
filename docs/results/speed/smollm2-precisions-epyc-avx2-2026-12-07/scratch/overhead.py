"""Fixed cost of a compiled decode step: SmolLM2's op graph (30 layers, 9/3 heads of 64, 272 cache slots) with tiny products."""
import sys, time, dataclasses, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "benchmarks"))  # the checkout's benchmarks/
from decode_smollm2 import default_gguf
from qkvlab.convert.load import load_any
from qkvlab.model.transformer import GPT
from qkvlab.decode import compiled as C, steps as S
from qkvlab.decode.choices import model_choices
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
cfg = load_any(default_gguf()).model.cfg
tiny = dataclasses.replace(cfg, d_model=64, d_head=64, n_head=9, mlp_hidden=64, vocab_size=64)
model = GPT(tiny).eval() if "--real" not in sys.argv else load_any(default_gguf()).model.eval()
# (attention written out: see ab2.py's mulsum_sdpa, which the variants' figures used)

STEPS = 64
import torch._inductor.config as ic
if "--kprof" in sys.argv: ic.cpp.enable_kernel_profile = True
for a in sys.argv:
    if a.startswith("opt:"):
        k, v = a[4:].split("="); setattr(ic, k, int(v)); print("set", k, v)
model = model_choices(model, 1).decode_model(model)  # the tree generate decodes through
with torch.inference_mode():
    step = C.compiled_step()
    cache = S.new_cache(model, 1, 272, static=True)
    C.warm_up(step, model, cache)
    best = 1e9
    for r in range(5):
        cache.reset()
        b = S.left_pad([[1] * 200])
        tok = S.prefill(model, cache, b).argmax(-1); pos = b.lengths.clone()
        st = C.steady(step)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            tok = st(model, cache, tok, pos).argmax(-1); pos += 1
        tok.item()
        best = min(best, (time.perf_counter() - t0) / STEPS)
    print(f"tiny-product step {best*1e3:.3f} ms")
    if "--profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile
        cache.reset(); b = S.left_pad([[1] * 200])
        tok = S.prefill(model, cache, b).argmax(-1); pos = b.lengths.clone()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                tok = st(model, cache, tok, pos).argmax(-1); pos += 1
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        for e in rows[:25]: print(f"{e.self_cpu_time_total/20e3:8.3f} ms/step {e.count/20:6.1f}/step  {e.key[:50]}..{e.key[-20:]}")
