"""Cached decoding == full forward for every scheme and position encoding (left-padded batches too),
sampling, cache bytes, the transformers twin, and the generate/bench command lines."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import SCHEMES
from qkvlab.base.errors import UserError
from qkvlab.base.measured import MIN_NOISE
from qkvlab.bench import BenchConfig, hf_twin, variant_configs
from qkvlab.cli import main
from qkvlab.decode import compiled
from qkvlab.decode.choices import decode_choices, model_choices
from qkvlab.decode.compiled import compiled_step, steady
from qkvlab.decode.generate import FINISHED, generate, stream
from qkvlab.decode.sampling import Sampling, filter_logits, next_token
from qkvlab.decode.steps import decode_step, left_pad, new_cache, prefill
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.cache import KVCache
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

POS = ["learned", "rope", "none"]
VOCAB = 50


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: a second OpenMP thread only spin-waits, badly so on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cfg_for(scheme: str, pos: str = "learned", kv_heads: int | None = None, **kw) -> ModelConfig:
    base = dict(
        attn=scheme,
        pos=pos,
        kv_heads=kv_heads,
        n_layer=2,
        n_head=4,
        d_model=32,
        vocab_size=VOCAB,
        context=24,
        bias=True,
    )
    return ModelConfig(**{**base, **kw}).validate()


def head_layouts(scheme: str) -> list[int | None]:
    """MHA, and GQA-2 and MQA where the scheme allows them."""
    out: list[int | None] = [None]
    for kv in (2, 1):
        try:
            cfg_for(scheme, kv_heads=kv)
            out.append(kv)
        except UserError:
            pass
    return out


CASES = [(s, p, kv) for s in SCHEMES for p in POS for kv in head_layouts(s)]


def make_model(cfg: ModelConfig, dtype=torch.float64, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():  # larger weights than GPT-2's init: attention patterns far from uniform
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            elif "score_term" in name:
                p.normal_(0.0, 0.5)
    return model.to(dtype)


def decode_batched(model, prompts, cont, *, static=False, step=decode_step, spare=0, layout=False):
    """Prefill the left-padded prompts, then feed cont (B, N) one token per step ->
    logits (B, N+1, V): after the prompt, then after each fed token. spare: unused cache slots.
    layout: through the tree of the layout generate chooses (Linear products in blocks), as eager CPU
    generate runs."""
    batch = left_pad(prompts)
    cache = new_cache(model, len(prompts), batch.idx.shape[1] + cont.shape[1] + spare, static=static)
    if layout:
        model = model_choices(model, len(prompts)).decode_model(model)
        assert model.lm_head.__class__.__name__ == "PackedLinear"
    with torch.inference_mode():
        out = [prefill(model, cache, batch)]
        pos = batch.lengths.clone()
        for t in range(cont.shape[1]):
            out.append(step(model, cache, cont[:, t], pos))
            pos += 1
    return torch.stack(out, 1)


PROMPT_LENGTHS = (5, 1, 9)


@pytest.mark.parametrize("scheme,pos,kv", CASES, ids=[f"{s}-{p}-kv{kv}" for s, p, kv in CASES])
def test_cached_decoding_left_padded_equals_full_forward_float64(scheme, pos, kv):
    cfg = cfg_for(scheme, pos, kv)
    model = make_model(cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    cont = torch.randint(0, VOCAB, (len(prompts), 6), generator=g)
    batched = decode_batched(model, prompts, cont)
    static = decode_batched(model, prompts, cont, static=True, spare=3)  # full-length reads, masked slots
    torch.testing.assert_close(static, batched, rtol=1e-10, atol=1e-10)
    laid = decode_batched(model, prompts, cont, layout=True)  # generate's eager CPU path
    torch.testing.assert_close(laid, batched, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        for r, p in enumerate(prompts):
            full = model(torch.tensor([p + cont[r].tolist()]))[0][0, len(p) - 1 :]  # every step
            torch.testing.assert_close(batched[r], full, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(static[r], full, rtol=1e-10, atol=1e-10)
            alone = decode_batched(model, [p], cont[r : r + 1])[0]  # the row decoded on its own
            torch.testing.assert_close(batched[r], alone, rtol=1e-10, atol=1e-10)


def test_static_cache_then_a_multi_token_forward_continues_exactly():
    """After static steps the host-side length is stale until the next dynamic forward syncs it."""
    model = make_model(cfg_for("Q-K=V", "rope", 2))
    seq = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = new_cache(model, 2, 14, static=True)
    with torch.inference_mode():
        model(seq[:, :5], cache=cache)
        for t in range(5, 8):
            decode_step(model, cache, seq[:, t], torch.full((2,), t))
        tail, _ = model(seq[:, 8:], cache=cache)
        full, _ = model(seq)
    torch.testing.assert_close(tail, full[:, 8:], rtol=1e-10, atol=1e-10)
    assert cache.length == 12 and int(cache.slot) == 11


def test_static_step_compiles_once_per_batch_and_cache_length():
    """Same shapes every token: dynamo traces the step once per (batch, cache length), never per token."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(decode_step, backend=counter, dynamic=False, fullgraph=True)
    model = make_model(cfg_for("(Q-K=V)+", "rope", None))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 2)]
    cont = torch.randint(0, VOCAB, (2, 5), generator=g)
    eager = decode_batched(model, prompts, cont)
    traced = decode_batched(model, prompts, cont, static=True, step=step)
    torch.testing.assert_close(traced, eager, rtol=1e-10, atol=1e-10)
    assert counter.frame_count == 1
    decode_batched(model, prompts, cont, static=True, step=step)  # a new cache of the same shape
    assert counter.frame_count == 1
    decode_batched(model, prompts[:1], cont[:1], static=True, step=step)  # batch 1: one more
    assert counter.frame_count == 2


def test_stream_compiles_ahead_and_reports_once(monkeypatch):
    """compile=True: the step is compiled before the prompt is read, the time reported once, and the
    tokens equal the eager dynamic path's (dynamo with its eager backend stands in for inductor)."""
    torch._dynamo.reset()
    monkeypatch.setitem(
        compiled._COMPILED, ("default", False, "cpu"), torch.compile(decode_step, backend="eager", dynamic=False)
    )
    model = make_model(cfg_for("Q-K-V", "learned", 2), dtype=torch.float32)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    reports = []
    s = Sampling(temperature=1.0, top_k=20)
    got = generate(model, prompts, 9, s, seed=5, compile=True, on_compiled=reports.append)
    assert got == generate(model, prompts, 9, s, seed=5, static=False)
    assert got == generate(model, prompts, 9, s, seed=5, static=True)
    assert len(reports) == 1 and reports[0] > 0
    with pytest.raises(UserError, match="static"):
        stream(model, prompts, 3, compile=True, static=False)
    with pytest.raises(UserError, match="compile mode"):
        stream(model, prompts, 3, compile="fastest")


def test_generate_decodes_as_the_choices_passed_in_say_and_refuses_choices_for_another_dtype():
    """Choices are values: the same tokens whatever layout they name (fp64: the products agree to
    1e-12), the model's own modules never replaced; choices made for bf16 refuse an fp64 model."""
    model = make_model(cfg_for("Q-K=V", "rope", 2))
    modules = {n: (m, dict(vars(m))) for n, m in model.named_modules()}
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    want = generate(model, prompts, 8, Sampling(temperature=0.0))
    for layout in ("stored", "rows", "columns", "kmajor"):
        choices = decode_choices(model.cfg, dtype="fp64", layout=layout, batch=2, parts=2)
        assert (choices.layout, choices.layout_source, choices.layout_decision) == (layout, "as set", None)
        assert generate(model, prompts, 8, Sampling(temperature=0.0), choices=choices) == want
    assert {n: (m, dict(vars(m))) for n, m in model.named_modules()} == modules
    with pytest.raises(UserError, match="decode choices made for bf16 weights, but the model's are fp64"):
        stream(model, prompts, 3, choices=decode_choices(model.cfg, dtype="bf16", batch=2))
    with pytest.raises(UserError, match="decode layout 'diagonal' is not one of auto, stored, rows"):
        decode_choices(model.cfg, dtype="fp64", layout="diagonal")


def test_prefill_updates_next_pos_in_place():
    """CUDA graphs hold the address of every cache tensor (compiled.warm_up marks them static): a
    prefill that replaced next_pos would make the first step after it re-record the graph."""
    model = make_model(cfg_for("Q-K-V"), dtype=torch.float32)
    cache = new_cache(model, 2, 12, static=True)
    held = {id(t): t.data_ptr() for t in cache.tensors()}
    with torch.inference_mode():
        logits = prefill(model, cache, left_pad([[1, 2, 3], [4, 5]]))
        decode_step(model, cache, logits.argmax(-1), torch.tensor([3, 2]))
    assert cache.next_pos.tolist() == [4, 3]
    assert {id(t): t.data_ptr() for t in cache.tensors()} == held


def test_steady_skips_the_guards_of_a_compiled_step_only_and_generate_calls_it_after_the_first_step():
    """compiled.steady: the eager step is itself; any other step runs under skip_guard_eval_unsafe, and
    generate's loop calls the step itself first (guards checked) and the steady one after it."""
    import qkvlab.decode.generate as gen

    assert steady(decode_step) is decode_step
    stances = []

    def step(*args):
        stances.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)
        return decode_step(*args)

    model = make_model(cfg_for("Q-K=V", "rope", 2), dtype=torch.float32)
    cache = new_cache(model, 1, 8, static=True)
    list(gen._steps(model, cache, left_pad([[1, 2, 3]]), 4, Sampling(temperature=0), None, None, step, None))
    assert stances == [False, True, True] and not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


def test_a_failing_compiler_falls_back_to_eager_with_one_line(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no working C compiler\nsecond line")

    monkeypatch.setitem(compiled._COMPILED, ("reduce-overhead", False, "cpu"), broken)
    model = make_model(cfg_for("Q-K-V"), dtype=torch.float32)
    reports = []
    got = generate(
        model, [[1, 2, 3]], 6, Sampling(temperature=0), compile="reduce-overhead", on_compiled=reports.append
    )
    assert got == generate(model, [[1, 2, 3]], 6, Sampling(temperature=0))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compiling the decode step failed" in err[0] and "RuntimeError" in err[0]
    assert reports == []


@pytest.mark.slow
def test_compiled_step_equals_eager_float64():
    """Inductor's compiled static step (one compile, small shape) equals the eager dynamic path."""
    model = make_model(cfg_for("Q-K=V", "rope", 1))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3)]
    cont = torch.randint(0, VOCAB, (2, 6), generator=g)
    eager = decode_batched(model, prompts, cont)
    compiled = decode_batched(model, prompts, cont, static=True, step=compiled_step(), layout=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-10)


FP32_CASES = [
    ("Q-K-V", "learned", None),
    ("Q-K=V", "rope", 1),
    ("(Q=K=V)+", "rope", None),
    ("Id-K=V", "none", 2),
    ("Q-Id-V", "rope", None),
    ("(Q=K-V)+", "learned", None),
]


@pytest.mark.parametrize("scheme,pos,kv", FP32_CASES)
def test_cached_decoding_equals_full_forward_float32(scheme, pos, kv):
    model = make_model(cfg_for(scheme, pos, kv), dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3)]
    cont = torch.randint(0, VOCAB, (2, 8), generator=g)
    batched = decode_batched(model, prompts, cont)
    with torch.no_grad():
        for r, p in enumerate(prompts):
            full = model(torch.tensor([p + cont[r].tolist()]))[0][0, len(p) - 1 :]
            torch.testing.assert_close(batched[r], full, rtol=1e-5, atol=2e-5)


def test_left_pad_layout():
    b = left_pad([[4, 5, 6], [7]])
    assert b.idx.tolist() == [[4, 5, 6], [0, 0, 7]]
    assert b.positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert b.token_mask.tolist() == [[True] * 3, [False, False, True]]
    assert left_pad([[1, 2], [3, 4]]).token_mask is None


@pytest.mark.parametrize("scheme,pos", [("Q-K-V", "learned"), ("Q-K=V", "rope"), ("(Q=K-V)+", "none")])
def test_greedy_generate_is_repeated_argmax_of_full_forward(scheme, pos):
    model = make_model(cfg_for(scheme, pos))
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    got = generate(model, prompts, 10, Sampling(temperature=0.0))
    for p, new in zip(prompts, got):
        x = list(p)
        with torch.no_grad():
            for _ in range(10):
                x.append(int(model(torch.tensor([x]))[0][0, -1].argmax()))
        assert new == x[len(p) :]


def test_generation_stops_at_context_and_at_end_of_text():
    model = make_model(cfg_for("Q-K=V", "learned"))
    p = [1, 2, 3]
    # the last sampled token is never fed, so context - len(prompt) + 1 tokens fit
    assert len(generate(model, [p], 1000, Sampling(0.0))[0]) == model.cfg.context - len(p) + 1
    ref = generate(model, [p, [4, 5]], 8, Sampling(0.0))
    eot = ref[0][3]
    cut = ref[0].index(eot)
    got = generate(model, [p, [4, 5]], 8, Sampling(0.0), eot_id=eot)
    assert got[0] == ref[0][:cut]
    other = ref[1].index(eot) if eot in ref[1] else len(ref[1])
    assert got[1] == ref[1][:other]
    steps = list(stream(model, [p, [4, 5]], 8, Sampling(0.0), eot_id=eot))
    assert all(int(s[0]) == FINISHED for s in steps[cut + 1 :])


def test_sampling_is_deterministic_with_a_seed():
    model = make_model(cfg_for("Q-K-V", "rope"), dtype=torch.float32)
    s = Sampling(temperature=1.0, top_k=20, top_p=0.95)
    prompts = [[1, 2, 3], [4]]
    a = generate(model, prompts, 15, s, seed=123)
    assert a == generate(model, prompts, 15, s, seed=123)
    assert a != generate(model, prompts, 15, s, seed=124)
    g = torch.Generator().manual_seed(123)
    assert a == generate(model, prompts, 15, s, generator=g)


def test_top_k_top_p_on_a_known_distribution():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # shuffled so the scatter back is tested
    logits = probs.log()[None]
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_k=0) == [True] * 4 and kept(top_k=9) == [True] * 4
    assert kept(top_p=0.4) == [False, True, False, False]
    assert kept(top_p=0.75) == [False, True, False, True]
    assert kept(top_p=0.85) == [False, True, True, True]
    assert kept(top_p=1.0) == [True] * 4
    assert kept(top_k=3, top_p=0.6) == [False, True, False, True]
    # sampled frequencies: the kept tokens renormalised, temperature sharpening p -> p^(1/T)
    g = torch.Generator().manual_seed(0)
    n = 20000
    draws = next_token(logits.expand(n, 4), Sampling(temperature=1.0, top_k=2), g)
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.5 / 0.8) < 0.015
    draws = next_token(logits.expand(n, 4), Sampling(temperature=0.5), g)
    expected = probs**2 / (probs**2).sum()
    freq = torch.bincount(draws, minlength=4).float() / n
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    assert next_token(logits, Sampling(temperature=0.0)).item() == 1


@pytest.mark.parametrize(
    "bad,needle",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_values(bad, needle):
    with pytest.raises(UserError, match=needle):
        Sampling(**bad).validate()


def test_bad_generate_arguments_raise_before_decoding():
    model = make_model(cfg_for("Q-K-V"))
    for prompts, n, needle in [
        ([[1] * 25], 3, "longer than the model's context"),
        ([[]], 3, "empty prompt"),
        ([[1, 99]], 3, "outside the vocabulary"),
        ([[1]], 0, "max_new_tokens"),
    ]:
        with pytest.raises(UserError, match=needle):
            stream(model, prompts, n)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cache_bytes_allocated_equal_analytic(scheme):
    for kv in head_layouts(scheme):
        cfg = cfg_for(scheme, kv_heads=kv)
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            cache = KVCache(cfg, 3, 17, dtype=dtype)
            assert cache.bytes_allocated() == kv_cache_bytes_per_token(cfg, name) * 3 * 17


def test_cache_fractions_are_exact():
    base = dict(n_layer=3, n_head=8, d_model=64, vocab_size=VOCAB, context=32)
    full = KVCache(ModelConfig(attn="Q-K-V", **base).validate(), 2, 32).bytes_allocated()
    kv = KVCache(ModelConfig(attn="Q-K=V", **base).validate(), 2, 32).bytes_allocated()
    mqa = KVCache(ModelConfig(attn="Q-K=V", kv_heads=1, **base).validate(), 2, 32).bytes_allocated()
    assert 2 * kv == full and 2 * 8 * mqa == full


@pytest.mark.parametrize(
    "scheme,kv",
    [
        ("Q-K-V", None),
        ("Q-K-V", 2),
        ("Id-K-V", None),
        ("Q-Id-V", None),
        ("Q=K-V", None),
        ("Q-K=V", 1),
        ("Q=K=V", None),
        ("Id-K=V", None),
        ("Q-K-Id", None),
    ],
)
def test_transformers_gpt2_twin_computes_the_same_logits(scheme, kv):
    pytest.importorskip("transformers")
    cfg = cfg_for(scheme, kv_heads=kv, attn_scale=0.37, bias=kv is None)
    model = make_model(cfg, dtype=torch.float32)
    hf = hf_twin(model)
    x = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], rtol=1e-4, atol=1e-4)


def test_bench_variants_use_the_compare_notation():
    cfgs = variant_configs(BenchConfig(variants="Q-K-V, Q-K=V/mqa ,Q-K=V/GQA-2", preset="tiny").validate())
    assert [n for n, _ in cfgs] == ["Q-K-V", "Q-K=V/MQA", "Q-K=V/GQA-2"]
    assert [c.n_kv_heads for _, c in cfgs] == [4, 1, 2]
    for bad in ("Q-K=V:mqa", ",", "Q-X-V"):
        with pytest.raises(UserError):
            BenchConfig(variants=bad, preset="tiny").validate()


# ---- command lines ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen") / "m"
    assert (
        main(
            [
                "init",
                "--out",
                str(d),
                "--preset",
                "tiny",
                "--vocab-size",
                "256",
                "--context",
                "32",
                "--attn",
                "Q-K=V",
                "--pos",
                "rope",
            ]
        )
        == 0
    )
    return d


def test_cli_generate_streams_with_bytes_tokenizer(model_dir, capsys, monkeypatch):
    import sys

    writes = []
    real = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: (writes.append(s), real(s))[1])
    rc = main(
        [
            "generate",
            str(model_dir),
            "--prompt",
            "Hi",
            "--tokenizer",
            "bytes",
            "--max-new-tokens",
            "12",
            "--seed",
            "0",
            "--temperature",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("Hi") and out.endswith("\n")
    assert len([w for w in writes if w]) > 2  # printed piece by piece, not at the end


def test_cli_generate_with_saved_char_tokenizer_and_ids(model_dir, tmp_path, capsys):
    import shutil

    from qkvlab.data.tokenizer import CharTokenizer

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    CharTokenizer.train(["abcdefgh ij"]).save(d / "tokenizer")
    assert main(["generate", str(d), "--prompt", "abc", "--max-new-tokens", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("abc")
    assert (
        main(
            [
                "generate",
                str(d),
                "--prompt-ids",
                "1,2",
                "--prompt-ids",
                "3",
                "--max-new-tokens",
                "4",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("--- sample") == 2


def test_cli_generate_compile_reports_once(model_dir, capsys, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setitem(
        compiled._COMPILED, ("default", False, "cpu"), torch.compile(decode_step, backend="eager", dynamic=False)
    )
    argv = ["generate", str(model_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--temperature", "0"]
    assert main([*argv, "--compile"]) == 0
    ahead = capsys.readouterr()
    assert ahead.err.count("compiled the decode step") == 1
    assert main(argv) == 0  # auto: off on a CPU
    eager = capsys.readouterr()
    assert "compiled" not in eager.err and eager.out == ahead.out


def bf16_probe(calls: list):
    """A decode probe that always finds bf16 faster (no timing), counting its calls."""
    from qkvlab.decode import dtype_probe

    def probe(model_cfg, batches=(1,), **_):
        calls.append(tuple(batches))
        shape = dtype_probe.DecodeShape.of(model_cfg, max(batches)).key
        return dtype_probe.Decision("bf16", 2.0, 1.0, MIN_NOISE, shape, "tests", "cached", step="decode")

    return probe


def test_the_tests_decode_probe_is_fixed_at_fp32():
    """conftest's autouse fixture: generate's and serve's auto never time anything in-process."""
    from qkvlab.decode.dtype_probe import inference_dtype

    cfg = ModelConfig(d_model=32, n_head=4, vocab_size=64, context=32)
    dname, decision = inference_dtype("auto", "cpu", cfg, (1, 16))
    assert dname == "fp32" and decision.source == "fixed by the tests" and decision.step == "decode"


def test_cli_generate_loads_the_dtype_the_probe_chose(model_dir, capsys, monkeypatch):
    """--dtype auto on the CPU: the weights in the probe's dtype, its decision on stderr; an explicit
    dtype is never probed."""
    import qkvlab.commands.generate as cmd
    from qkvlab.decode import dtype_probe

    calls, loaded = [], []
    monkeypatch.setattr(dtype_probe, "cpu_decode_dtype", bf16_probe(calls))
    real = cmd.load_model
    monkeypatch.setattr(
        cmd, "load_model", lambda *a, **kw: (lambda out: (loaded.append(out[0]), out)[1])(real(*a, **kw))
    )
    argv = ["generate", str(model_dir), "--prompt-ids", "1,2,3", "--prompt-ids", "4", "--max-new-tokens", "3"]
    argv += ["--temperature", "0", "--device", "cpu"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert calls == [(2,)] and next(loaded[-1].parameters()).dtype == torch.bfloat16
    assert "qkvlab generate: dtype auto -> bf16: bf16 weights 2.00x fp32 on a decode step" in err, err
    assert main([*argv, "--dtype", "fp32"]) == 0
    assert calls == [(2,)] and next(loaded[-1].parameters()).dtype == torch.float32
    assert "dtype auto" not in capsys.readouterr().err


def _bad(tmp_path, model_dir):
    import pickle

    pkl = tmp_path / "pkl"
    pkl.mkdir()
    (pkl / "config.json").write_text((model_dir / "config.json").read_text())
    (pkl / "model.safetensors").write_bytes(pickle.dumps({"w": 1}))
    (tmp_path / "weights.pt").write_bytes(b"\x80\x04junk")
    m = str(model_dir)
    tok = ["--tokenizer", "bytes"]
    return [
        [m, "--prompt", "x" * 40, *tok],
        [m, "--prompt", "", *tok],
        [m, "--prompt-ids", ""],
        [m, "--prompt-ids", "1,a"],
        [str(pkl), "--prompt-ids", "1"],
        [str(tmp_path / "weights.pt"), "--prompt-ids", "1"],
        [str(tmp_path / "nothing"), "--prompt-ids", "1"],
        [m, "--prompt", "hi"],  # no tokenizer recorded
        [m, "--prompt", "hi", *tok, "--temperature", "-1"],
        [m, "--prompt", "hi", *tok, "--top-p", "0"],
        [m, "--prompt", "hi", *tok, "--top-p", "1.01"],
        [m, "--prompt", "hi", *tok, "--top-k", "-3"],
        [m, "--prompt", "hi", *tok, "--max-new-tokens", "0"],
        [m, "--prompt", "hi", "--tokenizer", "nope"],
        [m, "--prompt", "hi", *tok, "--device", "tpu9"],
    ]


def test_cli_generate_bad_input_one_line_exit_2(model_dir, tmp_path, capsys):
    for argv in _bad(tmp_path, model_dir):
        rc = main(["generate", *argv])
        captured = capsys.readouterr()
        assert rc == 2, argv
        assert captured.out == "", argv
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "error" in lines[0], (argv, captured.err)


def test_cli_bench_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "b.json"
    csv = tmp_path / "cmp"
    csv.mkdir()
    (csv / "results.csv").write_text(
        "variant,kv_cache_bytes_per_token,val_loss_mean,ppl_change_pct_mean\n"
        "Q-K-V,4096,3.1,0\nQ-K=V,2048,3.2,3.1\nQ-K=V/MQA,256,3.25,4.8\n"
    )
    rc = main(
        [
            "bench",
            "--preset",
            "tiny",
            "--context",
            "32",
            "--schemes",
            "Q-K-V,Q-K=V/MQA",
            "--batch",
            "2",
            "--decode-batches",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
            "--rounds",
            "1",
            "--train-steps",
            "1",
            "--train-batch",
            "1",
            "--memory-budget",
            "1GB",
            "--json",
            str(out),
            "--compare-dir",
            str(csv),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())["schemes"]
    assert list(data) == ["Q-K-V", "Q-K=V/MQA"]
    for r in data.values():
        for key in ("kv_cache_bytes_allocated", "kv_cache_bytes_analytic", "decode_tokens_per_s", "train_tokens_per_s"):
            assert r[key] > 0, key
        # transformers' decode time is its generate's time less its prefill's: on a loaded machine two
        # decode steps can come out at or below zero, which bench reports as unmeasured (None), never as a rate
        assert r["hf_decode_tokens_per_s"] is None or r["hf_decode_tokens_per_s"] > 0
        assert r["kv_cache_bytes_allocated"] == r["kv_cache_bytes_analytic"]
        assert r["hf_max_logit_diff"] < 1e-4
        for key in (  # prefill and decode apart, and the bandwidth limit, per decode batch
            "prefill_tokens_per_s_by_batch",
            "decode_step_ms_by_batch",
            "end_to_end_tokens_per_s_by_batch",
            "bandwidth_limit_step_ms_by_batch",
            "bandwidth_fraction_by_batch",
        ):
            assert r[key]["1"] > 0, key
        hf_step = r["hf_decode_step_ms_by_batch"]["1"]
        assert (hf_step is None) == (r["decode_speedup_vs_hf"]["1"] is None) and (hf_step is None or hf_step > 0)
        assert r["decode_tokens_per_s"] == pytest.approx(1e3 / r["decode_step_ms_by_batch"]["1"])
    assert json.loads(out.read_text())["copy_bytes_per_s"] > 0
    full = data["Q-K-V"]["kv_cache_bytes_allocated"]
    assert 2 * 4 * data["Q-K=V/MQA"]["kv_cache_bytes_allocated"] == full  # tiny: 4 heads
    assert data["Q-K=V/MQA"]["capacity_sequences"] > data["Q-K-V"]["capacity_sequences"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_bench_auto_dtype_on_the_cpu_follows_the_decode_probe(tmp_path, decode_probe_bf16):
    """`bench --dtype auto` decodes in what a timed decode step of its shapes chose (here a fake
    probe says bf16), and records that decision; an explicit dtype is never probed."""
    asked = decode_probe_bf16
    args = ["bench", "--preset", "tiny", "--context", "32", "--schemes", "Q-K-V", "--batch", "2"]
    args += ["--decode-batches", "1,2", "--prompt-len", "4", "--new-tokens", "2", "--rounds", "1", "--no-train"]
    args += ["--no-hf", "--memory-budget", "1GB", "--device", "cpu"]
    assert main([*args, "--json", str(tmp_path / "auto.json")]) == 0
    auto = json.loads((tmp_path / "auto.json").read_text())
    assert auto["dtype"] == "bf16" and auto["schemes"]["Q-K-V"]["dtype"] == "bf16"
    assert auto["decode_dtype_probe"]["dtype"] == "bf16" and asked == [(1, 2)]
    assert main([*args, "--dtype", "fp32", "--json", str(tmp_path / "fp32.json")]) == 0
    fixed = json.loads((tmp_path / "fp32.json").read_text())
    assert fixed["dtype"] == "fp32" and fixed["decode_dtype_probe"] is None and asked == [(1, 2)]
