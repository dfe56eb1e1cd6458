import time, torch, torch.nn.functional as F, sys
torch.set_num_threads(int(sys.argv[1]))
hot = "hot" in sys.argv
S, L = 272, 30
def mk(*s): return [torch.randn(*s)] * L if hot else [torch.randn(*s) for _ in range(L)]
qs = mk(1, 3, 3, 64); ks = mk(1, 3, S, 64); vs = mk(1, 3, S, 64)
mask = torch.ones(1, 1, 1, S, dtype=torch.bool); mask[..., 264:] = False
sc = 0.125
def sdpa(q, k, v): return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sc)
def sdpa_nomask(q, k, v): return F.scaled_dot_product_attention(q, k[:, :, :264], v[:, :, :264], scale=sc)
def mulsum(q, k, v):
    s = (q[..., :, None, :] * k[..., None, :, :]).sum(-1) * sc  # (1,3,3,S)
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p[..., :, :, None] * v[..., None, :, :]).sum(-2)
def readonly(q, k, v): return k.sum() + v.sum()
def chain(f):
    def g(qs, ks, vs):
        return [f(q, k, v) for q, k, v in zip(qs, ks, vs)]
    return g
ways = {}
for n, f in dict(sdpa=sdpa, sdpa_nomask=sdpa_nomask, mulsum=mulsum, readonly=readonly).items():
    ways["eager_" + n] = chain(f)
    ways["comp_" + n] = torch.compile(chain(f), options={"cpp_wrapper": True})
for n, f in ways.items(): f(qs, ks, vs)
best = {n: 1e9 for n in ways}
for r in range(7):
    for n, f in ways.items():
        t = time.perf_counter()
        for _ in range(20): f(qs, ks, vs)
        best[n] = min(best[n], (time.perf_counter() - t) / 20 / L)
for n, t in best.items(): print(f"{n:18s} {t*1e6:7.1f} us per layer")
