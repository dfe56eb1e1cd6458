"""A/B of compiled decode-step variants, batch 1, alternating rounds in one process.
usage: ab2.py VARIANTS(comma; each '+'-joined of: base mulsum rN freeze) ROUNDS [--tiny]"""
import sys, time, dataclasses, statistics, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "benchmarks"))  # the checkout's benchmarks/
from decode_smollm2 import default_gguf
from qkvlab.convert.load import load_any
from qkvlab.model.transformer import GPT
from qkvlab.decode import compiled as C, steps as S
from qkvlab.decode.choices import model_choices
import qkvlab.model.attention as A
torch.set_num_threads(2)
ORIG = A.sdpa
def mulsum_sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p):
    B, hq, T, hd = q.shape
    hk = k.shape[1]
    if T == 1 and not is_causal and (attn_mask is None or attn_mask.shape[1] == 1):
        qg = q.reshape(B, hk, hq // hk, 1, hd)
        s = (qg * k[:, :, None]).sum(-1) * scale  # (B, hk, g, S)
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf"))
        p = s.softmax(-1)
        return (p[..., None] * v[:, :, None]).sum(-2).reshape(B, hq, 1, hd)
    return ORIG(q, k, v, attn_mask, is_causal, scale, dropout_p)
def patch(v):
    A.sdpa = mulsum_sdpa if "mulsum" in v else ORIG
model = load_any(default_gguf()).model.eval()
if "--tiny" in sys.argv:
    model = GPT(dataclasses.replace(model.cfg, d_model=64, mlp_hidden=64, vocab_size=64)).eval()
V = model.cfg.vocab_size
prompt = torch.randint(0, V, (1, 200), generator=torch.Generator().manual_seed(0))
STEPS = 48
variants = sys.argv[1].split(",")
ROUNDS = int(sys.argv[2])
def make(name):
    def step_fn(m, c, t, p):
        return S.decode_step(m, c, t, p)
    opts = {"cpp_wrapper": True}
    for part in name.split("+"):
        if part == "freeze": opts["freezing"] = True
        if part.startswith("r") and part[1:].isdigit(): opts["realize_opcount_threshold"] = int(part[1:])
    return torch.compile(step_fn, dynamic=False, fullgraph=True, options=opts)
model = model_choices(model, 1).decode_model(model)  # the tree generate decodes through
steps, caches = {}, {}
with torch.inference_mode():
    for v in variants:
        caches[v] = S.new_cache(model, 1, 200 + STEPS + 8, static=True)
        patch(v)
        steps[v] = make(v)
        t = time.perf_counter()
        C.warm_up(steps[v], model, caches[v])
        print(v, "compiled in", round(time.perf_counter() - t, 1), flush=True)
    times = {v: [] for v in variants}
    toks = {}
    for r in range(ROUNDS):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            patch(v)
            cache = caches[v]; cache.reset()
            batch = S.left_pad(prompt.tolist())
            tok = S.prefill(model, cache, batch).argmax(-1); pos = batch.lengths.clone(); out = [tok]
            st = C.steady(steps[v])
            t0 = time.perf_counter()
            for _ in range(STEPS):
                tok = st(model, cache, tok, pos).argmax(-1); pos += 1; out.append(tok)
            out = [int(t) for t in out]
            times[v].append((time.perf_counter() - t0) / STEPS); toks[v] = out
b0 = statistics.median(times[variants[0]])
for v in variants:
    best, med = min(times[v]), statistics.median(times[v])
    ratios = [a / b for a, b in zip(times[variants[0]], times[v])]
    print(f"{v:28s} best {best*1e3:7.2f} ms  median {med*1e3:7.2f}  {1/best:6.1f} tok/s  x{b0/med:.3f} vs first (per round {min(ratios):.2f}-{max(ratios):.2f})  same tokens: {toks[v] == toks[variants[0]]}")
