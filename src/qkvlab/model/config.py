"""Model configuration (one dataclass) and the papers' presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from qkvlab.base.config_file import read_config_file
from qkvlab.base.errors import UserError
from qkvlab.base.settings import check, resolve, seed_setting, setting
from qkvlab.model.accounting import matched_mlp_hidden
from qkvlab.model.positions import PLUS_ENCODINGS
from qkvlab.model.spec import LATENT, ProjectionSpec, parse_layers, parse_scheme, validate_heads

NORMS = ("layernorm", "rmsnorm", "none")
POSITIONS = ("learned", "rope", "sinusoidal", "none")
MLPS = ("gelu", "gelu_tanh", "relu", "swiglu")
NORM_POSITIONS = ("pre", "post")
OUTPUT_HEADS = ("linear", "mlp", "norm_mlp")

# ---- presets --------------------------------------------------------------------------------
# Papers' models: figures in papers.md. Small ones are sized for 2 CPU cores.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": dict(  # Paper A (nanoGPT GPT-2 small)
        n_layer=12, n_head=12, d_model=768, vocab_size=50304, context=1024, bias=False, pos="learned"
    ),
    "paperB-300m": dict(
        n_layer=20, n_head=16, d_model=1024, mlp_hidden=4096, vocab_size=50304, context=2048, bias=True
    ),
    "paperB-1.2b": dict(
        n_layer=22, n_head=32, d_model=2048, mlp_hidden=8192, vocab_size=50304, context=2048, bias=True
    ),
    "tiny": dict(n_layer=2, n_head=4, d_model=64, vocab_size=512, context=64),
    "small": dict(n_layer=4, n_head=4, d_model=128, vocab_size=2048, context=128),
}
DEFAULT_PRESET = "small"  # what a command builds when neither a preset nor a model folder is named


@dataclass
class ModelConfig:
    presets: ClassVar[dict[str, dict[str, Any]]] = PRESETS  # what a `preset` key names (settings.resolve)

    attn: str = setting("Q-K-V", help="projection scheme, e.g. Q-K-V, Id-K-V, Q-K=V, '(Q=K-V)+'", metavar="SCHEME")
    n_layer: int = setting(4, help="transformer blocks", minimum=1)
    n_head: int = setting(4, help="query heads", minimum=1)
    d_model: int = setting(128, help="residual stream width", minimum=1)
    d_head: int | None = setting(None, help="width of one head (default d_model / n_head)", minimum=1)
    kv_heads: int | None = setting(None, help="key/value heads (default n_head: MHA; g: GQA-g; 1: MQA)", minimum=1)
    kv_latent: int | None = setting(
        None,
        help="cache one latent of this many numbers per token and layer, keys and values read back from it "
        "(a low-rank K/V cache; schemes with separate learned K and V)",
        minimum=1,
    )
    rope_dim: int | None = setting(
        None,
        help="Multi-head Latent Attention (DeepSeek's layout): with --kv-latent R, a RoPE key of this many numbers "
        "per token shared by every head is cached beside the normalised latent, each query head gets as many "
        "rotated dimensions, and the latent's keys get no RoPE, so decoding reads the R + P numbers as they are "
        "(even, at most d_head; pos=rope only)",
        minimum=2,
    )
    latent_norm_eps: float = setting(
        1e-6,
        help="eps of MLA's latent norm (DeepSeek's kv_a_layernorm: 1e-6); far above the latent's mean square the norm "
        "is a fixed scale, which is how a retrofit keeps each token's latent as fitted (docs/retrofit.md)",
        positive=True,
    )
    layers: str | None = setting(
        None,
        help="per-layer schemes/kv heads over attn and kv_heads, e.g. 'Q-K=V@every4', 'Q-K=V/MQA@-4:' (docs/schemes.md)",
        metavar="PATTERN",
    )
    attn_scale: float | None = setting(
        None,
        help="score scale (default 1/sqrt(d_head), 1/(2 sqrt(d_head)) with an identity Q or K)",
        metavar="S",
        positive=True,
    )
    plus_channels: int = setting(10, help="channels m of the 2D positional score term ('+' schemes)")
    plus_encoding: str = setting(
        "original",
        help="the '+' term's 2D encoding: original (PositionalEncoding2D(m), Borji's) or halves (m/2 + m/2)",
        choices=PLUS_ENCODINGS,
    )
    mlp: str = setting("gelu", help="MLP activation", choices=MLPS)
    mlp_hidden: int | None = setting(
        None, help="MLP width (default 4 * d_model; with --match-params: the reference model's width)", minimum=1
    )
    match_params: str | None = setting(
        None, help="re-spend saved attention params on the MLP to match SCHEME's count", metavar="SCHEME"
    )
    norm: str = setting("layernorm", help="normalisation", choices=NORMS)
    norm_eps: float = setting(1e-5, help="epsilon of the norms", minimum=0)
    norm_position: str = setting(
        "pre", help="pre: x + f(norm(x)); post: norm(x + f(x)) (Borji's encoder)", choices=NORM_POSITIONS
    )
    mlp_skip: bool = setting(True, help="residual skip around the MLP (Paper A's theorems need it off)")
    share_layers: bool = setting(False, help="one block's weights for every layer (ALBERT-style)")
    pos: str = setting("learned", help="input positions (sinusoidal: fixed, added to the input)", choices=POSITIONS)
    rope_theta: float = setting(10000.0, help="rotary base (pos=rope)", positive=True)
    vocab_size: int = setting(256, help="vocabulary size (tasks fit it to their data)", minimum=1)
    context: int = setting(256, help="longest sequence (positions)", minimum=1)
    bias: bool = setting(False, help="biases in linear layers")
    dropout: float = setting(0.0, help="dropout probability, in [0, 1)", minimum=0)
    tie_embeddings: bool = setting(True, help="output head shares the token embedding")
    causal: bool = setting(True, help="causal attention (set by the task)", cli=False)
    init_std: float = setting(0.02, help="std of the normal initialisation", minimum=0)
    head: str = setting(
        "linear",
        help="encoders' output head: linear; mlp (Linear-act-Linear, Borji's ViT); norm_mlp (+ a norm, his encoder)",
        choices=OUTPUT_HEADS,
    )

    # ---- derived -------------------------------------------------------------------------
    @property
    def spec(self) -> ProjectionSpec:
        return parse_scheme(self.attn)

    @property
    def per_layer(self) -> bool:
        return self.layers is not None

    def layer_table(self) -> tuple[tuple[str, int | None], ...]:
        """(scheme, kv_heads) of every layer."""
        if self.layers is None:
            return ((self.attn, self.kv_heads),) * self.n_layer
        return parse_layers(
            self.layers, n_layer=self.n_layer, n_head=self.n_head, attn=self.attn, kv_heads=self.kv_heads
        )

    def layer_config(self, i: int) -> ModelConfig:
        """Layer i's config: this one with that layer's attn and kv_heads (itself for one-scheme
        models). The MLP width stays the model's (match_params is resolved once, model-wide)."""
        if self.layers is None:
            return self
        attn, kv = self.layer_table()[i]
        return dataclasses.replace(self, attn=attn, kv_heads=kv, layers=None, mlp_hidden=self.hidden, match_params=None)

    def layer_configs(self) -> list[ModelConfig]:
        if self.layers is None:
            return [self] * self.n_layer
        return [self.layer_config(i) for i in range(self.n_layer)]

    @property
    def scheme_label(self) -> str:
        """The scheme for humans: 'Q-K-V', or with per-layer schemes 'Q-K-V [Q-K=V@every4]'."""
        label = self.spec.name if self.layers is None else f"{self.spec.name} [{self.layers}]"
        if self.kv_latent is None:
            return label
        return (
            f"{label} (kv_latent={self.kv_latent}"
            + ("" if self.rope_dim is None else f", rope_dim={self.rope_dim}")
            + ")"
        )

    def cached_tensors(self) -> dict[int, tuple[int, int]]:
        """What a one-scheme config's KV cache holds per token: {source: (heads, width)}. The distinct key/value
        tensors (K and V two, K=V one, kv_heads heads of d_head), or one latent of kv_latent numbers (with MLA's
        rotated key of rope_dim numbers after it, in the same row)."""
        if self.kv_latent is not None:
            return {LATENT: (1, self.kv_latent + (self.rope_dim or 0))}
        return {s: (self.n_kv_heads, self.head_dim) for s in self.spec.cached_sources()}

    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_head

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.n_head

    @property
    def scale(self) -> float:
        if self.attn_scale is not None:
            return self.attn_scale
        if self.rope_dim is not None:  # MLA: a query-key product over d_head + rope_dim numbers (DeepSeek's scale)
            return (self.head_dim + self.rope_dim) ** -0.5
        ident = self.spec.identity_role
        # Paper A: raw coordinates as queries (or keys) make scores larger at init.
        factor = 2.0 if ident in ("q", "k") else 1.0
        return 1.0 / (factor * self.head_dim**0.5)

    @property
    def hidden(self) -> int:
        if self.match_params is not None:
            return matched_mlp_hidden(self)
        return self.mlp_hidden if self.mlp_hidden is not None else 4 * self.d_model

    def validate(self) -> ModelConfig:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        spec = self.spec  # raises on a bad scheme
        if self.d_head is None and self.d_model % self.n_head:
            raise UserError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}; set d_head explicitly")
        validate_heads(spec, d_model=self.d_model, n_head=self.n_head, d_head=self.head_dim, kv_heads=self.n_kv_heads)
        if self.layers is not None:
            if self.share_layers:
                raise UserError(
                    f"layers={self.layers!r} with share_layers=True: one shared block cannot have per-layer schemes"
                )
            for i, (attn, kv) in enumerate(self.layer_table()):
                lspec, lkv = parse_scheme(attn), kv if kv is not None else self.n_head
                try:
                    validate_heads(lspec, d_model=self.d_model, n_head=self.n_head, d_head=self.head_dim, kv_heads=lkv)
                except UserError as e:
                    raise UserError(f"layers={self.layers!r}, layer {i}: {e}") from None
                if lspec.plus and (self.plus_channels < 2 or self.plus_channels % 2):
                    raise UserError(f"plus_channels={self.plus_channels} must be an even number >= 2")
        if self.kv_latent is not None:
            self._check_latent(spec)
        elif self.rope_dim is not None:
            raise UserError(
                f"rope_dim={self.rope_dim} needs kv_latent: it is the RoPE part of Multi-head Latent Attention "
                "(e.g. --kv-latent 128 --rope-dim 64)"
            )
        if self.pos == "rope" and self.head_dim % 2:
            raise UserError(f"pos=rope needs an even d_head, got {self.head_dim}")
        if spec.plus and (self.plus_channels < 2 or self.plus_channels % 2):
            raise UserError(f"plus_channels={self.plus_channels} must be an even number >= 2")
        if self.norm_position == "post" and not self.mlp_skip:
            raise UserError(
                "norm_position=post needs the MLP skip (mlp_skip=True); a post-norm block without it is undefined"
            )
        if not self.dropout < 1.0:
            raise UserError(f"dropout={self.dropout} must be in [0, 1)")
        if self.match_params is not None:
            parse_scheme(self.match_params)
            if self.hidden <= 0:
                raise UserError(f"match_params={self.match_params!r} would need a non-positive MLP width")
        return self

    def _check_latent(self, spec: ProjectionSpec) -> None:
        r, width = self.kv_latent, 2 * self.n_kv_heads * self.head_dim
        own = lambda role: not spec.is_identity(role) and spec.projections[spec.role_source(role)] == (role,)  # noqa: E731
        if not (own("k") and own("v")) or spec.plus:
            raise UserError(
                f"kv_latent={r} with {spec.name}: a latent replaces separate learned key and value projections "
                "(Q-K-V, Id-K-V)"
            )
        if self.layers is not None:
            raise UserError(f"kv_latent={r} with layers={self.layers!r}: a latent is one setting for every layer")
        p = self.rope_dim or 0
        if r + p >= width:
            what = f"kv_latent={r}" if p == 0 else f"kv_latent + rope_dim = {r} + {p}"
            raise UserError(
                f"{what} must be below 2 * kv_heads * d_head = {width} (the keys and values themselves: no saving)"
            )
        if self.rope_dim is not None:
            self._check_rope_dim(spec)

    def _check_rope_dim(self, spec: ProjectionSpec) -> None:
        p = self.rope_dim
        if self.pos != "rope":
            raise UserError(
                f"rope_dim={p} with pos={self.pos}: a model without RoPE has no positional key to keep apart; "
                "its --kv-latent alone is already MLA's cache (decoded absorbed)"
            )
        if p % 2 or p > self.head_dim:
            raise UserError(f"rope_dim={p} must be an even number from 2 to d_head={self.head_dim} (rotary pairs)")
        if spec.is_identity("q"):
            raise UserError(
                f"rope_dim={p} with {spec.name}: MLA's queries carry rope_dim rotated numbers beyond the head's "
                "d_head, which an identity query has not; use Q-K-V"
            )

    # ---- serialisation (JSON, never pickle) ----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Validated config from a mapping (optionally with a `preset`); keys an older file lacks
        take the defaults."""
        return resolve(cls, data)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Model preset `name` with the overrides that are not None."""
    return resolve(ModelConfig, {"preset": name}, {k: v for k, v in overrides.items() if v is not None})


def model_file_settings(path: str) -> dict[str, Any]:
    """A model config file's settings: ModelConfig keys (optionally a `preset`), or the `model`
    section of a training config or a saved config.json."""
    body = read_config_file(path)
    return body["model"] if isinstance(body.get("model"), dict) else body


@dataclass
class InitConfig:
    """What `qkvlab init` writes: a random model of the chosen config (`--config FILE`: a model config)."""

    out: str = setting(help="model folder to write", metavar="DIR")
    seed: int = seed_setting(0, help="seed of the random weights")
    overwrite: bool = setting(False, help="replace DIR if it already holds a model")
    preset: str | None = setting(None, help=f"start from a model preset (default {DEFAULT_PRESET})", choices=PRESETS)
    model: dict[str, Any] = setting(help="model options", default_factory=dict, group=ModelConfig)
