"""Ready for GPUs without one: device selection, the "+" term inside the dot product (exact against
the explicit S*sum(w) + a(i) + c(j) + b formula), export on a non-CPU device, FSDP for every scheme."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import PLUS_SCHEMES, SCHEMES
from qkvlab.base.devices import select_device
from qkvlab.base.errors import UserError
from qkvlab.decode.steps import decode_step, left_pad, new_cache, prefill
from qkvlab.model.attention import Attention, sdpa
from qkvlab.model.config import ModelConfig
from qkvlab.model.positions import apply_rotary, encoding_2d
from qkvlab.model.spec import parse_scheme
from qkvlab.model.transformer import GPT

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1. device selection


@pytest.mark.parametrize("world", [1, 8])
def test_device_selection_always_indexes_cuda(world):
    for rank in range(world):
        for requested in ("auto", "cuda"):
            assert select_device(requested, rank, world, cuda_count=8) == torch.device("cuda", rank)
        assert select_device("auto", rank, world, cuda_count=0) == torch.device("cpu")
        assert select_device("cpu", rank, world, cuda_count=8) == torch.device("cpu")
        if world == 1:
            assert select_device("cuda:3", rank, world, cuda_count=8) == torch.device("cuda", 3)
        else:  # under torchrun every rank would land on cuda:3
            with pytest.raises(UserError, match="device=cuda:3 with 8 ranks would put every rank on one GPU"):
                select_device("cuda:3", rank, world, cuda_count=8)
        with pytest.raises(UserError, match="no CUDA device"):
            select_device("cuda", rank, world, cuda_count=0)
    assert select_device("cuda", 0, 1, cuda_count=1).index == 0  # one GPU: cuda:0, never bare "cuda"
    with pytest.raises(UserError, match="LOCAL_RANK=1 .* only 1 CUDA"):
        select_device("auto", 1, 2, cuda_count=1)
    with pytest.raises(UserError, match="device=cuda:2 .* only 2"):
        select_device("cuda:2", 0, 1, cuda_count=2)


# ---------------------------------------------------------------- 4. the "+" term, exact


def legacy_forward(self, x, *, q_pos, rope=None, rope_k=None, cache=None, mask=None):
    """Attention.forward before the fast path: the explicit additive mask S*sum(w) + P[i, j] . w + b
    (b: the test's `legacy_bias` attribute), float mask, no causal kernel."""
    B, T, _ = x.shape
    src = self.spec.source
    new = self.project(x)
    q = new[src[0]]
    if rope is not None:
        q = apply_rotary(q, *rope)
        if not self.k_shared_with_v:
            new[src[1]] = apply_rotary(new[src[1]], *rope)
    if cache is not None:
        stored = {s: cache.update(s, new[s]) for s in self.spec.cached_sources()}
        k_pos = cache.key_positions()
    else:
        stored, k_pos = new, q_pos
    k, v = stored[src[1]], stored[src[2]]
    if rope is not None and self.k_shared_with_v:
        k = apply_rotary(k, *(rope_k if rope_k is not None else rope))
    term = self.score_term
    P = encoding_2d(term.max_positions, term.max_positions, term.channels, term.encoding).to(term.weight.dtype)
    qp, kp = q_pos.expand(B, -1), k_pos.expand(B, -1)
    pw = P[qp[:, :, None], kp[:, None, :]] @ term.weight  # P[i, j] . w, by the definition: (B, T, S)
    additive = (pw + self.legacy_bias)[:, None].to(q.dtype)  # (B, 1, T, S)
    q = q * term.score_scale()
    attn_mask = mask
    if attn_mask is None and self.causal and cache is None:
        attn_mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    attn_mask = additive if attn_mask is None else additive.masked_fill(~attn_mask, float("-inf"))
    y = sdpa(q, k, v, attn_mask, False, self.scale, 0.0)
    return self.out_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


def plus_model(scheme: str, pos: str, kv: int | None, head_dim: int = 8) -> GPT:
    cfg = ModelConfig(
        attn=scheme,
        pos=pos,
        kv_heads=kv,
        n_layer=2,
        n_head=4,
        d_model=4 * head_dim,
        d_head=head_dim,
        vocab_size=50,
        context=24,
    ).validate()
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "score_term" in name else 0.3)
    for blk in model.trunk.blocks:
        blk.attn.legacy_bias = torch.tensor(0.7, dtype=torch.float64)  # any b: it cancels
    return model.double()


def _mha_only(scheme: str) -> bool:
    """A projection shared with the query, or an identity role, fixes kv_heads = n_head."""
    spec = parse_scheme(scheme)
    return spec.identity_role is not None or any("q" in p and len(p) > 1 for p in spec.projections)


PLUS_CASES = [
    (s, p, kv)
    for s in PLUS_SCHEMES
    for p in ("rope", "learned")
    for kv in (None, 2, 1)
    if kv is None or not _mha_only(s)
]


@pytest.mark.parametrize("scheme,pos,kv", PLUS_CASES, ids=[f"{s}-{p}-kv{kv}" for s, p, kv in PLUS_CASES])
def test_plus_term_in_the_dot_product_equals_the_explicit_formula_float64(scheme, pos, kv, monkeypatch):
    head_dims = (8, 6) if kv is None else (8,)  # 6: the padding to a multiple of 8 is not a full block
    for hd in head_dims:
        model = plus_model(scheme, pos, kv, hd)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 50, (3, 17), generator=g)
        prompts = [x[0, :5].tolist(), x[1, :1].tolist(), x[2, :9].tolist()]
        cont = torch.randint(0, 50, (3, 4), generator=g)

        def run():
            with torch.no_grad():
                full = model(x)[0]  # training forward (causal)
                batch = left_pad(prompts)
                cache = new_cache(model, 3, batch.idx.shape[1] + cont.shape[1])
                steps = [prefill(model, cache, batch)]
                pos_ = batch.lengths.clone()
                for t in range(cont.shape[1]):
                    steps.append(decode_step(model, cache, cont[:, t], pos_))
                    pos_ += 1
            return full, torch.stack(steps, 1)

        fast = run()
        with monkeypatch.context() as m:
            m.setattr(Attention, "forward", legacy_forward)
            slow = run()
        for a, b in zip(fast, slow):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_row_term_and_bias_have_zero_gradient_and_old_checkpoints_load(monkeypatch, tmp_path):
    """The reason a(i) and b are not computed: softmax over keys cancels them (gradient 0)."""
    model = plus_model("(Q-K=V)+", "rope", None)
    attn = model.trunk.blocks[0].attn
    attn.legacy_bias = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    row = torch.zeros(24, dtype=torch.float64, requires_grad=True)  # an extra a(i) per position
    bias = attn.legacy_bias

    def with_row(self, x, **kw):
        self.legacy_bias = bias + row[kw["q_pos"]][..., None]  # (B, T, 1): a(i) + b
        return legacy_forward(self, x, **kw)

    monkeypatch.setattr(Attention, "forward", with_row)
    x = torch.randint(0, 50, (2, 12))
    model(x[:, :-1], x[:, 1:])[1].backward()
    monkeypatch.undo()
    assert bias.grad.abs().item() < 1e-12 and row.grad.abs().max().item() < 1e-12
    assert model.trunk.blocks[0].attn.score_term.weight.grad.abs().sum() > 0  # the rest does act
    # an old checkpoint's 0-dim score_term.bias loads (strictly) and is dropped
    state = {**model.state_dict(), "trunk.blocks.0.attn.score_term.bias": torch.tensor(0.5, dtype=torch.float64)}
    fresh = plus_model("(Q-K=V)+", "rope", None)
    fresh.load_state_dict(state, strict=True)
    assert all(p.dim() >= 1 for p in fresh.parameters())  # FSDP2 refuses 0-dim parameters
    # and a model folder written before (safetensors + config.json) loads through io.load_model
    from safetensors.torch import save_file

    from qkvlab.model.folder import load_model, save_model, state_dict_for_save

    save_model(tmp_path / "m", model, model.cfg)
    old = {**state_dict_for_save(model), "trunk.blocks.1.attn.score_term.bias": torch.tensor(0.5, dtype=torch.float64)}
    save_file(old, str(tmp_path / "m" / "model.safetensors"))
    loaded, _, _ = load_model(tmp_path / "m")
    x = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(loaded(x)[0], model(x)[0], rtol=0, atol=0)


def test_fast_path_keeps_the_causal_kernel_and_leaves_the_shared_tensor_alone(monkeypatch):
    """No float mask reaches SDPA in training (flash-eligible); K=V's shared tensor is untouched."""
    model = plus_model("(Q-K=V)+", "rope", None)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((kw.get("attn_mask"), kw.get("is_causal"), q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model(torch.randint(0, 50, (2, 10)))
    assert all(m is None and causal and dq == dk == dv == 16 for m, causal, dq, dk, dv in seen), seen


# ---------------------------------------------------------------- 3. export on the weights' device


@pytest.mark.parametrize(
    "scheme,fmt,pos,mlp,norm",
    [
        ("Id-K-V", "gpt2", "learned", "gelu", "layernorm"),
        ("Id-K=V", "llama", "rope", "swiglu", "rmsnorm"),
        ("Q-K=V", "gpt2", "none", "gelu", "layernorm"),
    ],
)
def test_export_builds_every_tensor_on_the_weights_device(scheme, fmt, pos, mlp, norm, monkeypatch):
    pytest.importorskip("transformers")
    from qkvlab.convert import hf

    cfg = ModelConfig(
        attn=scheme,
        pos=pos,
        mlp=mlp,
        norm=norm,
        n_layer=2,
        n_head=4,
        d_model=32,
        vocab_size=64,
        context=16,
        bias=fmt == "gpt2",
    ).validate()
    with torch.device("cpu"):
        model = GPT(cfg)
    model = model.to("meta")
    made = []
    real_load = torch.nn.Module.load_state_dict

    def check(self, sd, strict=True, assign=False):  # the export's tensors, before transformers sees them
        made.extend(v.device.type for v in sd.values())
        return real_load(self.to("meta"), sd, strict=strict, assign=True)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", check)
    hf.to_hf(model, cfg, fmt)
    assert made and set(made) == {"meta"}


# ---------------------------------------------------------------- 2. FSDP2 for every scheme


def test_fsdp_on_two_gloo_processes_trains_every_scheme_like_one_process(tmp_path):
    schemes = SCHEMES
    out = run_two_ranks([str(Path(__file__).with_name("fsdp_worker.py")), *schemes], tmp_path)
    diffs = json.loads(out.strip().splitlines()[-1])
    assert set(diffs) == set(schemes)
    assert all(d < 1e-5 for d in diffs.values()), diffs


def run_two_ranks(args: list[str], cwd: Path, timeout: float = 300) -> str:
    """`torchrun --nproc-per-node 2 ARGS`, its stdout. A rank that dies fails the test with torchrun's
    summary (which rank, which exit code or signal) and the ranks' stderr, where faulthandler has
    written the Python stack of a rank killed by a signal. A run past `timeout` fails the test the
    same way instead of hanging it: torchrun gets SIGTERM, which it passes on to the ranks (each in a
    session of its own) before it exits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"torchrun still running after {timeout:.0f} s, stopped; stderr:\n{err[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}: a rank failed or died; stderr:\n{err[-6000:]}")
    return out


def test_a_checkpoint_with_the_old_score_term_bias_resumes():
    """Optimizer state written before the bias was dropped loads (direct route; FSDP uses the same filter)."""
    from qkvlab.train.distributed import full_state, load_full_state
    from qkvlab.train.optim import make_optimizer

    model = plus_model("(Q=K-V)+", "rope", None).float()
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
    x = torch.randint(0, 50, (2, 9))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    w, o = full_state(model, opt)
    old = "trunk.blocks.1.attn.score_term.bias"
    w[old] = torch.tensor(0.0)
    o["state"][old] = {"step": torch.tensor(1.0), "exp_avg": torch.tensor(0.0), "exp_avg_sq": torch.tensor(0.0)}
    o["param_groups"][-1]["params"].append(old)
    fresh = plus_model("(Q=K-V)+", "rope", None).float()
    fresh_opt = make_optimizer(fresh, 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
    load_full_state(fresh, fresh_opt, w, o)
    assert str(fresh_opt.state_dict()) == str(opt.state_dict())


# ---------------------------------------------------------------- 3. rotary in the autocast dtype


@pytest.mark.parametrize("scheme", ["Q-K-V", "Q-K=V", "(Q-K=V)+", "Id-K-V"])
def test_q_and_k_reach_attention_in_the_autocast_dtype(scheme, monkeypatch):
    cfg = ModelConfig(attn=scheme, pos="rope", n_layer=1, n_head=4, d_model=32, vocab_size=50, context=16)
    model = GPT(cfg.validate())
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 50, (2, 10)))
    # an identity query is a view of the fp32 residual stream: autocast casts it at SDPA (on CUDA)
    want = (torch.float32 if scheme.startswith("Id") else torch.bfloat16, torch.bfloat16)
    assert seen and all(d == want for d in seen), seen


# ---------------------------------------------------------------- 5. memory per GPU


def _saved_bytes(model: GPT, B: int) -> int:
    """Bytes of the tensors autograd keeps for backward (distinct storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, model.cfg.vocab_size, (B, model.cfg.context + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x[:, :-1], x[:, 1:])
    return sum(n for ptr, n in seen.items() if ptr not in params)


MEMORY_CASES = [
    dict(attn="Q-K-V"),
    dict(attn="Id-K=V", pos="rope"),
    dict(attn="Q-K-V", kv_heads=2, pos="rope"),
    dict(attn="(Q-K-V)+"),
    dict(attn="(Q=K=V)+", pos="rope"),
    dict(attn="Q-K-V", pos="rope", mlp="swiglu", norm="rmsnorm"),
]


@pytest.mark.parametrize("over", MEMORY_CASES, ids=[str(c) for c in MEMORY_CASES])
def test_memory_estimate_against_real_tensors(over):
    from qkvlab.model.accounting import memory_estimate
    from qkvlab.train.optim import make_optimizer

    cfg = ModelConfig(n_layer=3, n_head=4, d_model=64, vocab_size=256, context=48, **over).validate()
    torch.manual_seed(0)
    model = GPT(cfg)
    est = memory_estimate(cfg, micro_batch=3, dtype="fp32")
    # activations + the log-softmax: measured from what autograd keeps (fp32, CPU's flash attention)
    saved = _saved_bytes(model, 3)
    expect = est["activations"] + est["logits"] // 3  # of the logits term (4 + 4 + 4 B), the saved fp32 part
    assert abs(saved - expect) / saved < 0.05, (saved, expect)
    # parameters, gradients, AdamW moments: exact byte counts
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
    x = torch.randint(0, 256, (2, 9))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    distinct = {p.data_ptr(): p for p in model.parameters()}.values()
    assert est["params"] == sum(p.nbytes for p in distinct) == sum(p.grad.nbytes for p in distinct) == est["grads"]
    moments = sum(s[k].nbytes for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert est["optimizer"] == moments
    # FSDP2 shards dim 0 of every parameter in ceil(rows / world) pieces: the estimate is within padding
    fsdp = memory_estimate(cfg, micro_batch=3, world=8, sharding="fsdp", dtype="fp32")
    per_rank = sum(4 * -(-p.shape[0] // 8) * (p.numel() // p.shape[0]) for p in distinct)
    assert fsdp["params"] <= per_rank <= fsdp["params"] * 1.02 and fsdp["optimizer"] == 2 * fsdp["params"]
    assert fsdp["activations"] == est["activations"] and fsdp["total"] < est["total"]
    assert fsdp["grads"] == fsdp["params"]  # no accumulation: gradients reduce-scattered each step
    # accumulation runs micro-batches with gradient sync off: FSDP2 keeps full fp32 gradients on every rank
    accum = memory_estimate(cfg, micro_batch=3, world=8, sharding="fsdp", dtype="fp32", accum_steps=4)
    assert accum["grads"] == est["grads"] and accum["params"] == fsdp["params"]
    assert accum["total"] - fsdp["total"] == est["grads"] - fsdp["grads"]


def test_info_memory_command(capsys):
    from qkvlab.cli import main

    assert (
        main(
            [
                "info",
                "--preset",
                "paperB-1.2b",
                "--memory",
                "--batch",
                "8",
                "--world",
                "8",
                "--sharding",
                "fsdp",
                "--json",
            ]
        )
        == 0
    )
    mem = json.loads(capsys.readouterr().out)["memory_per_gpu"]
    assert mem["world"] == 8 and mem["total"] == sum(
        mem[k] for k in ("params", "grads", "optimizer", "comm_buffers", "activations", "logits")
    )
    assert 0 < mem["total"] < 80 * 2**30  # the paper's 1.2B model fits an 80 GB GPU at micro-batch 8 on 8 GPUs
    assert main(["info", "--preset", "tiny", "--memory", "--batch", "0"]) == 2
    assert "--batch: 0 must be a positive integer" in capsys.readouterr().err


def test_compiled_forward_has_no_graph_break_with_the_plus_term_under_autocast():
    """torch.compile sees one graph: the autocast dtype query and the key-term channels trace."""
    cfg = ModelConfig(attn="(Q=K-V)+", pos="rope", n_layer=2, n_head=4, d_model=32, vocab_size=64, context=16)
    model = GPT(cfg.validate())
    x = torch.randint(0, 64, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(x[:, :-1], x[:, 1:])
    assert explained.graph_break_count == 0, explained.break_reasons


# ---------------------------------------------------------------- first-day GPU fixes, on the CPU


@pytest.mark.parametrize("scheme", ["Q-K=V", "(Q=K-V)+"])
def test_fsdp_bf16_policy_computes_what_ddp_autocast_computes(scheme, tmp_path):
    """FSDP2's bf16 policy (train.distributed.shard) against autocast on the unsharded model (what each
    DDP rank runs): the residual stream stays fp32 into every block, norms read fp32 weights, and the
    loss and gradients agree. Norm weights are moved off 1 and 0, so a bf16-rounded copy would show.
    "+": its weights are gathered in bf16 (docs/gpu.md), so only closely there."""
    import copy

    import torch.distributed as dist

    from qkvlab.train import distributed as D

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = ModelConfig(attn=scheme, n_layer=2, n_head=4, d_model=32, vocab_size=64, context=16, bias=True)
        tol = 1e-6 if "+" not in scheme else 2e-2
        torch.manual_seed(0)
        ref = GPT(cfg.validate())
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        model = copy.deepcopy(ref)
        D.shard(model, D.Env(device=torch.device("cpu")), param_dtype=torch.bfloat16)
        seen = []
        for block in model.trunk.blocks:
            block.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].dtype), with_kwargs=True)
        x = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
        losses = []
        for m in (model, ref):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x[:, :-1], x[:, 1:])[1]
            loss.backward()
            losses.append(loss.detach())
        assert seen == [torch.float32] * cfg.n_layer
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=tol)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-3 + tol, atol=tol, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_on_resume_only_rank_0_hashes_the_checkpoint(sharding, tmp_path, monkeypatch):
    """Every rank used to sha256 the whole checkpoint (14 GB per rank at 1.2B); now rank 0 verifies
    and shares its verdict, and the others check sizes and headers only. A damaged file is refused
    on every rank, with rank 0's line."""
    from qkvlab.train import checkpoint as ck
    from qkvlab.train import distributed as D
    from qkvlab.train import run_folder
    from qkvlab.train.config import TrainConfig

    model_cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32, context=8, tie_embeddings=False)
    cfg = TrainConfig(model=model_cfg, sharding=sharding)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    weights, optim = D.full_state(model, opt)
    ck.save_checkpoint(
        tmp_path,
        weights,
        optim,
        cfg.model,
        "gpt",
        {
            "step": 1,
            "tokens": 8,
            "metrics": [],
            "loss_sum": 0.0,
            "loss_n": 0,
            "elapsed_s": 0.0,
            "rng": [],
            "train_config": cfg.to_dict(),
        },
    )
    hashed = []
    real = ck.file_sha256
    monkeypatch.setattr(ck, "file_sha256", lambda f: hashed.append(f) or real(f))
    monkeypatch.setattr(D, "barrier", lambda env: None)
    monkeypatch.setattr(run_folder, "check_resumable", lambda saved, cfg, where: None)  # not under test here
    rank0_verdict = [None]
    monkeypatch.setattr(D, "all_gather_object", lambda env, obj: [obj if env.main else rank0_verdict[0], None])
    for rank in (1, 0):
        env = D.Env(rank=rank, world=2)
        saved = run_folder.read_checkpoint(cfg, tmp_path, env, resume=True)
        assert saved.state["step"] == 1
        assert bool(saved.weights) is (rank == 0 or sharding == "ddp")
        assert len(hashed) == (0 if rank else 2)  # rank 0: the two tensor files, once
    rank0_verdict[0] = "checkpoint/model.safetensors: size or sha256 differs (damaged)"
    with pytest.raises(UserError, match="damaged"):
        run_folder.read_checkpoint(cfg, tmp_path, D.Env(rank=1, world=2), resume=True)


def test_a_filesystem_without_locks_is_one_line(tmp_path, monkeypatch):
    """flock on NFS without lockd (or some Lustre mounts) fails with ENOLCK: a UserError naming the
    folder and the cause, not a bare OSError."""
    import errno

    fcntl = pytest.importorskip("fcntl")
    from qkvlab.base.folders import claim_folder

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(UserError, match=r"--out .*run: cannot lock .*No locks available.*does not support file locks"):
        claim_folder(tmp_path / "run", accept=(), advice={})


# ---------------------------------------------------------------- benchmarks/gpu_check.sh, dry
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_checks_cpu_dry_runs_every_check_or_skips_it(tmp_path):
    """benchmarks/gpu_checks.py --cpu-dry: one line per check in summary.txt, the CUDA-only ones
    SKIP, none FAIL; only summary.txt and checks.json in the output folder."""
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_checks.py"), "--cpu-dry", "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = (out / "summary.txt").read_text().splitlines()
    verdicts = {line.split()[1].rstrip(":"): line.split()[0] for line in lines}
    assert verdicts == {
        "flash": "PASS",
        "plus": "PASS",
        "memory": "SKIP",
        "mfu": "PASS",
        "fsdp": "PASS",
        "graphs": "SKIP",
    }
    assert sorted(p.name for p in out.iterdir()) == ["checks.json", "summary.txt"]
    figures = json.loads((out / "checks.json").read_text())
    assert figures["fsdp"]["verdict"] == "PASS" and "DCP" in figures["fsdp"]["figure"]


def test_gpu_check_sh_continues_past_failures_and_keeps_work_files_out(tmp_path):
    """With a Python that fails every command, the script still runs every check, writes a FAIL line
    for each, exits 1, and leaves only summary.txt and log.txt in OUT (work files in a temp folder)."""
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_check.sh"), "--cpu-dry"],
        env={**os.environ, "OUT": str(out), "PYTHON": "false"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert run.returncode == 1
    lines = (out / "summary.txt").read_text().splitlines()
    names = [line.split()[1].rstrip(":") for line in lines]
    assert names == ["gpu_checks", "cli-prepare", "cli-train", "cli-generate", "cli-bench"]
    assert all(line.startswith("FAIL ") for line in lines)
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "summary.txt"]
    assert list(tmp_path.iterdir()) == [out]


# `--dtype auto` (bf16 on CUDA, timed on the CPU): tests/test_dtype_probe.py
