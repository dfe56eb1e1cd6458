"""Variant notation, shared by compare, bench and their outputs: ``SCHEME[/OPTION...]``.

SCHEME is a projection scheme (``Q-K-V``, ``Id-K-V``, ``Q-K=V``, ``(Q=K-V)+`` ...); options:

- ``MQA``: one key/value head; ``GQA-g``: g key/value heads (the notation of per-layer
  ``--layers`` entries too: ``qkvlab.model.spec.parse_kv_heads``; also read as ``GQAg``, a bare count
  ``g``, or ``MHA`` for the default);
- ``mlp``: MLP widened so the parameter count equals Q-K-V's (Paper A's identity_larger_mlp);
  ``mlp=SCHEME`` matches another scheme's count (``Q-K-V/mlp=Id-K-V``: Paper A's
  original_smaller_mlp, MLP 3.5x at GPT-2 small);
- ``latent=R``: keys and values read back from one cached latent of R numbers per token
  (ModelConfig.kv_latent; Q-K-V and Id-K-V);
- ``rope=P`` (with ``latent=R``): Multi-head Latent Attention, a RoPE key of P numbers shared by every
  head cached beside the normalised latent (ModelConfig.rope_dim; Q-K-V, RoPE models);
- ``width=SCHEME``: d_model shrunk to the smallest multiple of n_head whose non-embedding
  parameters are at least SCHEME's (``Q-K-V/width=Id-K-V``: Paper A's original_smaller_overall,
  d_model 744 at GPT-2 small).

e.g. ``Id-K-V/mlp``, ``Q-K=V/MQA``, ``Q-K=V/GQA-4``, ``Id-K-V/MQA/latent=32``, ``Q-K-V/latent=96/rope=32``. ``/`` rather than the paper's "Q-K=V+MQA",
because ``+`` already means the 2D positional score term. A list is comma-separated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qkvlab.base.errors import UserError
from qkvlab.model.accounting import analytic_params
from qkvlab.model.config import ModelConfig
from qkvlab.model.spec import KV_HEADS_FORMS, format_kv_heads, is_kv_heads, parse_kv_heads, parse_scheme

BASELINE = "Q-K-V"


@dataclass(frozen=True)
class Variant:
    """A scheme plus the options compare varies: key/value heads and a parameter-matched MLP or
    width."""

    scheme: str  # canonical, e.g. "Q-K=V"
    kv_heads: int | None = None  # None: as many as query heads (MHA); 1: MQA; g: GQA-g
    match: str | None = None  # match_params scheme (MLP re-spends saved params)
    width: str | None = None  # d_model shrunk to this scheme's parameter count
    latent: int | None = None  # kv_latent: one cached latent of this many numbers per token
    rope: int | None = None  # rope_dim: MLA's shared RoPE key, cached beside the latent

    @property
    def name(self) -> str:
        out = self.scheme
        if self.kv_heads is not None:
            out += f"/{format_kv_heads(self.kv_heads)}"
        if self.latent is not None:
            out += f"/latent={self.latent}"
        if self.rope is not None:
            out += f"/rope={self.rope}"
        if self.match is not None:
            out += "/mlp" if self.match == BASELINE else f"/mlp={self.match}"
        if self.width is not None:
            out += f"/width={self.width}"
        return out

    @property
    def slug(self) -> str:
        """A folder name without shell-special characters: Q-K=V/MQA -> Q-K=V_MQA."""
        return self.name.replace("(", "").replace(")", "").replace("+", "plus").replace("/", "_")

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        """The variant's model config on top of a base config (validated: one-line errors)."""
        try:
            out = cfg.replace(
                attn=self.scheme,
                kv_heads=self.kv_heads,
                kv_latent=self.latent,
                rope_dim=self.rope,
                match_params=self.match,
            ).validate()
            if self.width is not None:
                out = out.replace(d_model=matched_width(out, self.width), d_head=None)
                if cfg.mlp_hidden is not None and cfg.mlp_hidden == 4 * cfg.d_model:
                    out = out.replace(mlp_hidden=None)  # keeps following 4 * d_model
                out = out.validate()
            return out
        except UserError as e:
            raise UserError(f"variant {self.name}: {e}") from None


def matched_width(cfg: ModelConfig, scheme: str) -> int:
    """Smallest multiple of n_head for d_model (d_head = d_model / n_head, MLP following d_model
    unless set) whose non-embedding parameter count is at least `cfg` with `scheme`'s. Paper A's
    original_smaller_overall: Q-K-V at d_model 744 vs Id-K-V at GPT-2 small."""
    target = analytic_params(cfg.replace(attn=scheme, match_params=None)).non_embedding
    follow = cfg.mlp_hidden is not None and cfg.mlp_hidden == 4 * cfg.d_model
    for k in range(1, cfg.d_model // cfg.n_head + 1):
        d = k * cfg.n_head
        trial = cfg.replace(d_model=d, d_head=None, mlp_hidden=None if follow else cfg.mlp_hidden)
        if analytic_params(trial).non_embedding >= target:
            return d
    return cfg.d_model


def parse_variant(text: str) -> Variant:
    parts = [p.strip() for p in text.strip().split("/")]
    if not parts[0]:
        raise UserError(
            f"variant {text!r} is empty; write SCHEME[/MQA|/GQA-g][/mlp[=SCHEME]|/width=SCHEME], e.g. Q-K=V/MQA"
        )
    try:
        scheme = parse_scheme(parts[0]).name
    except UserError as e:
        raise UserError(f"variant {text!r}: {e}") from None
    kv, match, width, kv_given = None, None, None, False
    numbers: dict[str, int] = {}  # latent=R, rope=P
    for opt in parts[1:]:
        if is_kv_heads(opt) and not kv_given:
            try:
                kv, kv_given = parse_kv_heads(opt), True  # MHA: None, the default
            except UserError as e:
                raise UserError(f"variant {text!r}: {e}") from None
        elif opt.lower() == "mlp" and match is None:
            match = BASELINE
        elif opt.lower().startswith("mlp=") and match is None:
            try:
                match = parse_scheme(opt[4:]).name
            except UserError as e:
                raise UserError(f"variant {text!r}: {e}") from None
        elif (key := opt.lower().partition("=")[0]) in ("latent", "rope") and "=" in opt and key not in numbers:
            value = opt.partition("=")[2]
            if not (value.isdigit() and int(value) > 0):
                raise UserError(
                    f"variant {text!r}: {key}={value!r} must be a positive whole number (numbers per token)"
                )
            numbers[key] = int(value)
        elif opt.lower().startswith("width=") and width is None and match is None:
            try:
                width = parse_scheme(opt[6:]).name
            except UserError as e:
                raise UserError(f"variant {text!r}: {e}") from None
        else:
            raise UserError(
                f"variant {text!r}: option {opt!r} is not kv heads ({KV_HEADS_FORMS}), mlp, mlp=SCHEME, width=SCHEME "
                "latent=R or rope=P "
                "(each at most once; mlp or width, not both), e.g. Q-K=V/MQA or Id-K-V/mlp"
            )
    if width is not None and match is not None:
        raise UserError(f"variant {text!r}: mlp and width both match parameters; give one (each at most once)")
    if "rope" in numbers and "latent" not in numbers:
        raise UserError(f"variant {text!r}: rope=P is MLA's RoPE key beside a latent; give latent=R too")
    return Variant(scheme, kv, match, width, numbers.get("latent"), numbers.get("rope"))


def parse_variants(text: str | Sequence[str]) -> list[Variant]:
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[Variant] = []
    for item in items:
        if item.strip():
            v = parse_variant(item)
            if v not in out:
                out.append(v)
    if not out:
        raise UserError(f"--variants {text!r} names no variant; e.g. Q-K-V,Id-K-V/mlp,Q-K=V/MQA")
    return out
