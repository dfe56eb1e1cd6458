"""Retrofit a trained model to K=V and/or fewer key/value heads: fit, then uptrain by distillation.

Per converted layer (any selection of layers; the result is a per-layer model, docs/schemes.md):

- keys are kept exactly when the kv heads stay (so rotary stays exact); with fewer kv heads each
  group of key heads is mean-pooled, as the GQA paper (Ainslie et al. 2023) does;
- the new value tensor is the (pooled) key for K=V, else the mean-pooled values; every source
  value head g is then fitted from it by least squares on calibration activations of real text,
  V_g ≈ V'_G M_g (+ c_g when out_proj has a bias), and M_g is folded into the output projection
  columns of the query heads that read g: W_O,h ← W_O,h M_gᵀ (b_O += W_O,h c_g). With
  pool="mean" and separate values the GQA paper's plain mean is kept (M = I).
  R² = 1 - SSE/SST of that fit is the layer's fit quality; with a cache budget the layers with the
  best R² are converted first until the KV cache is at most that fraction of the original's.
- then uptraining with the training engine (train/loop.py, resumable, checkpoints): the `distill`
  task (tasks/distill.py), LM loss plus KL(teacher || student) at temperature 1.

The report holds held-out perplexity of the original, after the fit and after uptraining, and the
KV-cache bytes per token before and after (bf16).

Over 400 lines: one method (calibrate, fit, fold, select layers, uptrain, report) whose
steps share the calibration activations.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkvlab.accounting import analytic_params, kv_cache_bytes_per_token
from qkvlab.config import ModelConfig
from qkvlab.convert.reparam import role_weights
from qkvlab.devices import DEVICE_HELP, TRAIN_DTYPES, check_device, check_dtype, dtype_choices, select_device
from qkvlab.errors import UserError
from qkvlab.files import atomic_dir, atomic_path
from qkvlab.io import is_model_folder
from qkvlab.model import GPT
from qkvlab.settings import check, setting
from qkvlab.spec import format_layers, parse_scheme, select_layers

TARGETS = ("Q-K-V", "Q-K=V")  # what a fit can reach: a learned query and key; values shared or not
POOLS = ("fit", "mean")
TOKENS_FILE = "tokens.safetensors"
REPORT = "retrofit.json"


# ---- sources: a qkvlab folder or a Hugging Face folder / .gguf ------------------------------------
@dataclass
class Source:
    model: GPT
    cfg: ModelConfig
    encode: Callable[[str], list[int]]
    eot_id: int | None
    kind: str  # "qkvlab" or "hf"
    tokenizer_dir: Path | None = None  # qkvlab: the folder's tokenizer/, copied beside the result
    decode: Callable[[list[int]], str] | None = None


def load_source(path: str | Path) -> Source:
    """The model (float32 or as stored) and its tokenizer."""
    path = Path(path)
    if is_model_folder(path):
        from qkvlab.data.tokenizer import load_tokenizer
        from qkvlab.io import load_model

        model, cfg, _ = load_model(path)
        tok_dir = path / "tokenizer"
        if not tok_dir.is_dir():
            raise UserError(f"{path}: no tokenizer/ folder (qkvlab train writes one); retrofit needs it to read text")
        tok = load_tokenizer(tok_dir)
        return Source(model, cfg, tok.encode, tok.eot_id, "qkvlab", tok_dir, tok.decode)
    from qkvlab.convert.hf import _transformers, from_hf, gguf_cache_folder, load_hf, quiet

    quiet()
    hf = load_hf(path)
    model, cfg = from_hf(hf)
    del hf
    ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    tok_folder = path if (path.is_dir() and (path / "config.json").exists()) else gguf_cache_folder(ggufs[0])
    try:
        tok = _transformers().AutoTokenizer.from_pretrained(tok_folder)
    except Exception as e:  # transformers raises many kinds
        raise UserError(f"{path}: no usable tokenizer beside the weights ({str(e).splitlines()[0][:160]})") from None

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    return Source(model, cfg, encode, tok.eos_token_id, "hf", None, tok.decode)


# ---- text: calibration/training tokens and held-out tokens ----------------------------------------
def corpus_tokens(src: Source, data: Any = None, heldout_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every document's first (1 - f) tokens train (and calibrate), its last f are held out."""
    from qkvlab.data.text import load_corpus

    train: list[int] = []
    held: list[int] = []
    eot = [] if src.eot_id is None else [src.eot_id]
    for doc in load_corpus(data):
        if not doc.text:
            continue
        ids = src.encode(doc.text)
        cut = round(len(ids) * (1 - heldout_fraction))
        train += ids[:cut] + eot
        held += ids[cut:] + eot
    if len(train) < 2 or len(held) < 2:
        raise UserError(f"corpus {data!r} is too small to hold out {heldout_fraction:.0%} of it")
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


def write_tokens(path: Path, train: torch.Tensor, held: torch.Tensor) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({"train": train.contiguous(), "val": held.contiguous()}, str(tmp))


@torch.no_grad()
def perplexity(model: GPT, tokens: torch.Tensor, *, block: int, max_tokens: int, batch: int = 4) -> float:
    """exp(mean next-token NLL) over consecutive non-overlapping windows of `block` tokens."""
    n = min(len(tokens) - 1, max_tokens) // block
    if n == 0:
        raise UserError(f"held-out text has {len(tokens)} tokens, fewer than one window of {block}")
    p = next(model.parameters())
    model.eval()
    total = 0.0
    for lo in range(0, n, batch):
        rows = range(lo, min(n, lo + batch))
        x = torch.stack([tokens[i * block : (i + 1) * block] for i in rows]).to(p.device)
        y = torch.stack([tokens[i * block + 1 : (i + 1) * block + 1] for i in rows]).to(p.device)
        _, loss = model(x, y)
        total += float(loss) * len(rows)
    return math.exp(total / n)


# ---- the fit ----------------------------------------------------------------------------------------
@dataclass
class LayerFit:
    layer: int
    r2: float  # of the source values from the new value tensor (1.0: nothing fitted)
    cache_bytes_before: int  # per token, bf16
    cache_bytes_after: int


@torch.no_grad()
def attention_inputs(model: GPT, tokens: torch.Tensor, n_tokens: int, block: int) -> list[torch.Tensor]:
    """Each layer's attention input (after norm1) on the first n_tokens calibration tokens: (N, d)."""
    n = max(1, min(n_tokens, len(tokens) - 1) // block)
    x = tokens[: n * block].view(n, block)
    captured: list[list[torch.Tensor]] = [[] for _ in model.trunk.blocks]
    hooks = [
        blk.attn.register_forward_pre_hook(lambda m, args, i=i: captured[i].append(args[0].detach().flatten(0, 1)))
        for i, blk in enumerate(model.trunk.blocks)
    ]
    try:
        model.eval()
        p = next(model.parameters())
        for row in x.split(4):
            model(row.to(p.device))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(c).double().cpu() for c in captured]


def _heads(w: torch.Tensor, b: torch.Tensor | None, heads: int, hd: int):
    return w.view(heads, hd, -1), None if b is None else b.view(heads, hd)


def _pool(w: torch.Tensor, b: torch.Tensor | None, r: int):
    """Mean of each group of r consecutive heads: (h, hd, d) -> (h / r, hd, d)."""
    h = w.shape[0]
    wp = w.view(h // r, r, *w.shape[1:]).mean(1)
    return wp, None if b is None else b.view(h // r, r, -1).mean(1)


def fit_layer(block, x: torch.Tensor, dst_scheme: str, dst_kv: int, pool: str, ridge: float = 1e-10):
    """New fused in_proj rows, out_proj (weight, bias) and R² for one block; x: its (N, d) inputs."""
    attn = block.attn
    spec = attn.spec
    nh, hd, src_kv = attn.n_head, attn.head_dim, attn.kv_heads
    roles = role_weights(block, spec)
    if any(roles[r] is None for r in ("q", "k", "v")) or spec.plus or spec.shared("q", "k"):
        raise UserError(
            f"retrofit reads a layer with learned, separate query and key projections (Q-K-V, Q-K=V); this one is "
            f"{spec.name}"
        )
    if src_kv % dst_kv:
        raise UserError(f"kv_heads={dst_kv} must divide the layer's {src_kv} kv heads (heads are pooled, never split)")
    r = src_kv // dst_kv
    f64 = lambda t: None if t is None else t.detach().double()  # noqa: E731
    wq, bq = map(f64, roles["q"])
    wk, bk = _heads(f64(roles["k"][0]), f64(roles["k"][1]), src_kv, hd)
    wv, bv = _heads(f64(roles["v"][0]), f64(roles["v"][1]), src_kv, hd)
    wk2, bk2 = _pool(wk, bk, r)  # keys: exact when r == 1
    shared = parse_scheme(dst_scheme).shared("k", "v")
    wv2, bv2 = (wk2, bk2) if shared else _pool(wv, bv, r)

    def act(w, b):  # (N, heads, hd)
        out = torch.einsum("nd,hed->nhe", x, w)
        return out if b is None else out + b

    v_src, v_new = act(wv, bv), act(wv2, bv2)
    W_O = attn.out_proj.weight.detach().double().clone()  # (d, nh*hd)
    b_O = None if attn.out_proj.bias is None else attn.out_proj.bias.detach().double().clone()
    fit = shared or pool == "fit"
    sse = sst = 0.0
    maps = []
    for g in range(src_kv):
        target = v_src[:, g]  # (N, hd)
        sst += float(((target - target.mean(0)) ** 2).sum())
        if not fit:
            maps.append((torch.eye(hd, dtype=torch.float64), None))
            sse += float(((target - v_new[:, g // r]) ** 2).sum())
            continue
        A = v_new[:, g // r]
        if b_O is not None:  # an intercept can be folded into the output bias
            A = torch.cat([A, torch.ones(len(A), 1, dtype=A.dtype)], 1)
        gram = A.T @ A
        gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
        sol = torch.linalg.solve(gram, A.T @ target)  # (hd [+1], hd)
        sse += float(((A @ sol - target) ** 2).sum())
        maps.append((sol[:hd], sol[hd] if b_O is not None else None))
    per_kv = nh // src_kv
    old = W_O.clone()
    for h in range(nh):
        M, c = maps[h // per_kv]
        cols = slice(h * hd, (h + 1) * hd)
        W_O[:, cols] = old[:, cols] @ M.T
        if c is not None:
            b_O += old[:, cols] @ c
    flat = lambda w, b: (w.reshape(-1, w.shape[-1]), None if b is None else b.reshape(-1))  # noqa: E731
    rows = {"q": (wq, bq), "k": flat(wk2, bk2), "v": flat(wv2, bv2)}
    r2 = 1.0 - sse / sst if sst > 0 else 1.0
    return rows, (W_O, b_O), r2


def check_target(to: str):
    """The target scheme's spec, if a fit can reach it (before any model is read)."""
    dst = parse_scheme(to)
    if dst.name not in TARGETS:
        raise UserError(
            f"--to {to}: retrofit fits {' or '.join(TARGETS)} (with --kv-heads for GQA/MQA); an identity projection "
            "is removed exactly by `qkvlab convert`, a shared query/key has no fit that keeps the keys"
        )
    return dst


@dataclass
class FitResult:
    model: GPT
    cfg: ModelConfig
    layers: list[LayerFit] = field(default_factory=list)  # every candidate layer, converted or not
    converted: list[int] = field(default_factory=list)


def fit(
    model: GPT,
    cfg: ModelConfig,
    calib: torch.Tensor,
    *,
    to: str = "Q-K=V",
    kv_heads: int | None = None,
    layers: str | None = None,
    cache_budget: float | None = None,
    pool: str = "fit",
    calib_tokens: int = 2048,
    block: int | None = None,
    inputs: list[torch.Tensor] | None = None,
) -> FitResult:
    """The retrofitted model (in the source's dtype) and per-layer fit quality; see the module doc.
    inputs: the layers' calibration inputs from `attention_inputs` (computed here when None)."""
    dst = check_target(to)
    if pool not in POOLS:
        raise UserError(f"pool={pool!r} is not allowed; use one of {', '.join(POOLS)}")
    if kv_heads is not None and (kv_heads <= 0 or cfg.n_head % kv_heads):
        raise UserError(f"--kv-heads {kv_heads} must divide n_head={cfg.n_head}")
    if cache_budget is not None and not 0 < cache_budget <= 1:
        raise UserError(f"--cache-budget {cache_budget} must be a fraction in (0, 1]")
    if cfg.share_layers:
        raise UserError("share_layers=True: one block serves every layer, so layers cannot be retrofitted one by one")
    candidates = select_layers(layers, cfg.n_layer) if layers else list(range(cfg.n_layer))
    table = list(cfg.layer_table())
    block = block or min(cfg.context, 256)
    xs = inputs if inputs is not None else attention_inputs(model, calib, calib_tokens, block)
    fits: dict[int, tuple] = {}
    report: list[LayerFit] = []
    for i in candidates:
        lc = cfg.layer_config(i)
        kv = kv_heads or lc.n_kv_heads
        rows, out, r2 = fit_layer(model.trunk.blocks[i], xs[i], dst.name, kv, pool)
        fits[i] = (rows, out, kv)
        after = cfg.replace(attn=dst.name, kv_heads=kv, layers=None, match_params=None, n_layer=1)
        before = lc.replace(n_layer=1, layers=None, match_params=None)
        report.append(LayerFit(i, r2, kv_cache_bytes_per_token(before), kv_cache_bytes_per_token(after)))
    chosen = candidates
    if cache_budget is not None:
        total = kv_cache_bytes_per_token(cfg)
        goal = cache_budget * total
        chosen, now = [], total
        for lf in sorted(report, key=lambda f: -f.r2):  # best-fitting layers first
            if now <= goal + 1e-9:
                break
            if lf.cache_bytes_after < lf.cache_bytes_before:
                chosen.append(lf.layer)
                now -= lf.cache_bytes_before - lf.cache_bytes_after
        if now > goal + 1e-9:
            raise UserError(
                f"--cache-budget {cache_budget}: converting every candidate layer to {dst.name}"
                f"{'' if kv_heads is None else f'/{kv_heads}'} leaves {now / total:.3f} of the cache; "
                "allow more layers or fewer kv heads"
            )
        chosen.sort()
    for i in chosen:
        table[i] = (dst.name, fits[i][2])
    uniform = len(set(table)) == 1
    out_cfg = cfg.replace(
        attn=table[0][0] if uniform else cfg.attn,
        kv_heads=table[0][1] if uniform else cfg.kv_heads,
        layers=None if uniform else format_layers(tuple(table), (cfg.attn, cfg.kv_heads)),
        attn_scale=cfg.scale,
        mlp_hidden=cfg.hidden,
        match_params=None,
    ).validate()
    st = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i in chosen:
        rows, (w_o, b_o), _ = fits[i]
        p = f"trunk.blocks.{i}.attn."
        projections = parse_scheme(table[i][0]).projections
        st[p + "in_proj.weight"] = torch.cat([rows[roles[0]][0] for roles in projections], 0)
        if p + "in_proj.bias" in st:
            st[p + "in_proj.bias"] = torch.cat([rows[roles[0]][1] for roles in projections], 0)
        st[p + "out_proj.weight"] = w_o
        if b_o is not None:
            st[p + "out_proj.bias"] = b_o
    dtype = next(model.parameters()).dtype
    new = GPT(out_cfg).to(dtype)
    if out_cfg.tie_embeddings:
        st.pop("lm_head.weight", None)
    new.load_state_dict({k: v.to(dtype) for k, v in st.items()}, strict=not out_cfg.tie_embeddings)
    return FitResult(new.eval(), out_cfg, report, chosen)


# ---- the whole procedure ------------------------------------------------------------------------------
@dataclass
class RetrofitOptions:
    to: str = setting("Q-K=V", help="target scheme: Q-K=V, or Q-K-V with --kv-heads (plain GQA/MQA)", metavar="SCHEME")
    kv_heads: int | None = setting(
        None, help="key/value heads after pooling (GQA; 1: MQA; default: unchanged)", minimum=1
    )
    layers: str | None = setting(
        None,
        help="layers to convert: 'every4', '0,5,7', '-4:' (default: all, or as --cache-budget picks)",
        metavar="SEL",
    )
    cache_budget: float | None = setting(
        None,
        help="convert the best-fitting layers (R^2) until the KV cache is at most this fraction",
        metavar="F",
        positive=True,
        maximum=1,
    )
    pool: str = setting("fit", help="value heads: least-squares fit folded into out_proj, or plain mean", choices=POOLS)
    data: str | None = setting(
        None, help="text: a path, 'shakespeare[:genres]', 'hf:NAME?split=..' (default Shakespeare)", metavar="SOURCE"
    )
    heldout_fraction: float = setting(
        0.1, help="last fraction of every document held out for perplexity, in (0, 1)", positive=True
    )
    calib_tokens: int = setting(2048, help="calibration tokens for the fit", minimum=1)
    eval_tokens: int = setting(8192, help="held-out tokens scored for perplexity", minimum=1)
    block_size: int | None = setting(None, help="window length (default min(context, 256))", metavar="T", minimum=1)
    steps: int = setting(200, help="uptraining steps (0: fit only)", minimum=0)
    batch_size: int = setting(8, help="uptraining sequences per step", minimum=1)
    lr: float = setting(3e-4, help="uptraining peak learning rate (cosine to lr/10)", positive=True)
    warmup_steps: int = setting(20, help="uptraining warmup steps", minimum=0)
    kl_weight: float = setting(1.0, help="weight of KL(teacher || student) on logits, temperature 1", minimum=0)
    lm_weight: float = setting(1.0, help="weight of the LM loss (0: pure distillation)", minimum=0)
    eval_every: int = setting(50, help="uptraining steps between evaluations and checkpoints", minimum=1)
    eval_batches: int = setting(10, help="validation batches per uptraining evaluation", minimum=1)
    seed: int = setting(0, help="uptraining batch order", minimum=0)
    device: str = setting("auto", help=f"device for calibration and uptraining: {DEVICE_HELP}", metavar="DEVICE")
    dtype: str = setting(
        "auto",
        help="uptraining autocast dtype (auto: bf16 on CUDA, fp32 elsewhere)",
        choices=dtype_choices(TRAIN_DTYPES),
    )

    def validate(self) -> RetrofitOptions:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        check_target(self.to)
        if not self.heldout_fraction < 1:
            raise UserError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        if self.layers is not None and self.cache_budget is not None:
            raise UserError("give --layers or --cache-budget, not both (the budget chooses the layers)")
        check_dtype(self.dtype, TRAIN_DTYPES)
        check_device(self.device)
        return self


def check_layers(shape: tuple[int, int] | None, opts: RetrofitOptions) -> None:
    """--layers and --kv-heads against the source's (n_layer, n_head), before any weight is read or
    any perplexity measured."""
    if shape is None:
        return
    n_layer, n_head = shape
    if opts.layers is not None:
        select_layers(opts.layers, n_layer)
    if opts.kv_heads is not None and n_head % opts.kv_heads:
        raise UserError(f"--kv-heads {opts.kv_heads} must divide n_head={n_head}")


def source_shape(path: str | Path) -> tuple[int, int] | None:
    """(n_layer, n_head) from the source's config alone; None where only the weights say (.gguf)."""
    path = Path(path)
    from qkvlab.io import is_model_folder, read_config

    if is_model_folder(path):
        cfg = read_config(path)[0]
        return cfg.n_layer, cfg.n_head
    try:
        body = json.loads((path / "config.json").read_text())
        n_layer = body.get("num_hidden_layers", body.get("n_layer"))
        n_head = body.get("num_attention_heads", body.get("n_head"))
    except (OSError, ValueError, AttributeError):
        return None
    return (n_layer, n_head) if isinstance(n_layer, int) and isinstance(n_head, int) else None


@dataclass
class RetrofitConfig(RetrofitOptions):
    """`qkvlab retrofit`'s command line: the method's options plus where from and where to."""

    input: str = setting(
        help="qkvlab model folder, or a Hugging Face GPT-2/Llama folder or .gguf", positional=True, metavar="IN"
    )
    output: str = setting(
        help="folder to write (new or empty, or a retrofit to --resume)", positional=True, metavar="OUT"
    )
    resume: bool = setting(False, help="continue the uptraining in OUT")
    json: bool = setting(False, help="print the report as JSON before the last line")
    quiet: bool = setting(False, help="no progress output")

    def options(self) -> RetrofitOptions:
        """The method's part (what the report records)."""
        return RetrofitOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RetrofitOptions)})


def _owned(out: Path) -> bool:
    """An OUT this command wrote before (so --resume may continue it)."""
    return (out / TOKENS_FILE).is_file()  # written first, before any other file


def retrofit(
    source: str | Path, out: str | Path, opts: RetrofitOptions, *, resume: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Fit, uptrain and report into OUT (the final model folder). Returns the report dict.
    OUT is claimed and locked for the run (qkvlab.folders): missing, empty, or with resume=True a
    folder an earlier retrofit wrote; anything else is refused before writing."""
    from qkvlab.folders import claimed, inspect

    opts.validate()
    check_layers(source_shape(source), opts)
    out = Path(out)
    found = inspect(out)
    if found.kind not in ("missing", "empty"):
        if not resume:
            raise UserError(
                f"{out} holds {found.what}; pass --resume to continue a retrofit there, or choose another OUT"
            )
        if not _owned(out):
            raise UserError(
                f"{out} holds {found.what}, not written by qkvlab retrofit; choose another OUT (nothing was changed)"
            )
    with claimed(out, accept=("model", "other", "run"), advice={}, flag="OUT") as claim:
        return _retrofit(source, out, opts, claim, resume=resume, progress=progress)


def _retrofit(source, out: Path, opts: RetrofitOptions, claim, *, resume: bool, progress: bool) -> dict[str, Any]:
    from qkvlab.io import atomic_write, json_text, load_model, write_model_files

    device = select_device(opts.device)
    src = load_source(source)
    check_layers((src.cfg.n_layer, src.cfg.n_head), opts)  # a .gguf: known only now, still before any perplexity
    model, cfg = src.model.float().to(device), src.cfg
    block = opts.block_size or min(cfg.context, 256)
    train_ids, held_ids = corpus_tokens(src, opts.data, opts.heldout_fraction)
    tokens = out / TOKENS_FILE
    write_tokens(tokens, train_ids, held_ids)
    claim.keep = True  # from here OUT is a retrofit folder that --resume continues
    say = print if progress else (lambda *a, **k: None)
    ppl = lambda m: perplexity(m, held_ids, block=block, max_tokens=opts.eval_tokens)  # noqa: E731
    ppl_original = ppl(model)
    say(f"original {cfg.scheme_label}: held-out ppl {ppl_original:.4g}")
    res = fit(
        model,
        cfg,
        train_ids,
        to=opts.to,
        kv_heads=opts.kv_heads,
        layers=opts.layers,
        cache_budget=opts.cache_budget,
        pool=opts.pool,
        calib_tokens=opts.calib_tokens,
        block=block,
    )
    res.model.to(device)
    for lf in res.layers:
        mark = "converted" if lf.layer in res.converted else "kept"
        say(
            f"layer {lf.layer}: R^2 {lf.r2:.4f} cache/token {lf.cache_bytes_before} -> {lf.cache_bytes_after} B ({mark})"
        )
    (out / "fit").mkdir(exist_ok=True)
    meta = {"retrofit_from": str(source), "retrofit": asdict(opts)}
    write_model_files(out / "fit", res.model, res.cfg, meta)
    ppl_fit = ppl(res.model)
    say(f"fit {res.cfg.scheme_label}: held-out ppl {ppl_fit:.4g}")
    final, ppl_up, train_info = res.model, None, None
    if opts.steps > 0:
        from qkvlab.train.config import TrainConfig
        from qkvlab.train.loop import train

        tc = TrainConfig(
            task="distill",
            task_options={
                "teacher": str(Path(source).resolve()),
                "student": str((out / "fit").resolve()),
                "tokens": str(tokens.resolve()),
                "kl_weight": opts.kl_weight,
                "lm_weight": opts.lm_weight,
                "block_size": block,
            },
            model=res.cfg,
            seed=opts.seed,
            max_steps=opts.steps,
            batch_size=opts.batch_size,
            lr=opts.lr,
            warmup_steps=min(opts.warmup_steps, opts.steps),
            eval_every=min(opts.eval_every, opts.steps),
            eval_batches=opts.eval_batches,
            device=opts.device,
            dtype=opts.dtype,
            log_tensorboard=False,
        )
        result = train(tc, out / "uptrain", resume=resume, progress=progress)
        final, _, _ = load_model(out / "uptrain", device=device, dtype=torch.float32)
        ppl_up = ppl(final)
        train_info = {"steps": result.step, "tokens": result.tokens, "last": result.metrics}
        say(f"uptrained ({result.step} steps): held-out ppl {ppl_up:.4g}")
    before, after = kv_cache_bytes_per_token(cfg), kv_cache_bytes_per_token(res.cfg)
    report = {
        "source": str(source),
        "original_scheme": cfg.scheme_label,
        "scheme": res.cfg.scheme_label,
        "converted_layers": res.converted,
        "layers": [asdict(lf) for lf in res.layers],
        "options": asdict(opts),
        "heldout_tokens_evaluated": min(len(held_ids) - 1, opts.eval_tokens) // block * block,
        "calibration_tokens": min(opts.calib_tokens, len(train_ids) - 1) // block * block,
        "params_before": analytic_params(cfg).total,
        "params_after": analytic_params(res.cfg).total,
        "kv_cache_bytes_per_token_before": before,
        "kv_cache_bytes_per_token_after": after,
        "cache_ratio": after / before,
        "ppl_original": ppl_original,
        "ppl_fit": ppl_fit,
        "ppl_uptrained": ppl_up,
        "uptraining": train_info,
    }
    write_model_files(out, final, res.cfg, {**meta, "retrofit_report": REPORT})
    if src.tokenizer_dir is not None:
        with atomic_dir(out / "tokenizer") as tmp:
            shutil.copytree(src.tokenizer_dir, tmp, dirs_exist_ok=True)
    atomic_write(out / REPORT, json_text(report, indent=2))
    return report


def summary_line(report: dict[str, Any]) -> str:
    up = report["ppl_uptrained"]
    return (
        f"ppl_original={report['ppl_original']:.4g} ppl_fit={report['ppl_fit']:.4g} "
        f"ppl_uptrained={'none' if up is None else f'{up:.4g}'} cache_ratio={report['cache_ratio']:.4g}"
    )
