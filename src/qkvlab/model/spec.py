"""Projection schemes as data.

A scheme in the papers' notation (``Q-K-V``, ``Id-K-V``, ``Q-K=V``, ``(Q=K-V)+``, ...) lists the
three roles in the order query, key, value. Each role is its letter (a learned projection) or
``Id`` (the identity: head h reads input coordinates ``[h*d_head, (h+1)*d_head)``); ``=`` joins
roles that share one learned projection, ``-`` separates roles with their own. A trailing ``+``
(or ``(...)+``) adds Paper B's learned 2D positional term to the scores.

Parsing yields a :class:`ProjectionSpec`: for each role, the index of the learned projection it
reads, or ``IDENTITY``. Everything else (the attention module, parameter and cache accounting,
the KV cache, the converter and the exporter) reads this one table.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from qkvlab.base.errors import UserError

ROLES = ("q", "k", "v")
IDENTITY = -1
LATENT = -2  # the cached source of a low-rank key/value latent (ModelConfig.kv_latent), not a role's projection

# Schemes the papers name, with one line on what each means (shown by docs and `qkvlab info`).
KNOWN_SCHEMES = {
    "Q-K-V": "baseline: three learned projections",
    "Id-K-V": "Paper A: W_Q = identity, head h's query is input slice h (no query matmul)",
    "Q-Id-V": "W_K = identity (Paper A by symmetry)",
    "Q=K-V": "Paper B: one projection shared by query and key (symmetric scores), one for value",
    "Q-K=V": "Paper B: one projection shared by key and value (caches one tensor: 50%)",
    "Q=K=V": "Paper B: one projection for all three roles",
    "Q=V-K": "qkvlab: query and value share one projection, key apart (the control for Paper B's K=V)",
    "Id-K=V": "qkvlab: identity query plus one shared key/value projection",
    "(Q=K-V)+": "Q=K-V with the learned 2D positional score term",
    "(Q=K=V)+": "Q=K=V with the learned 2D positional score term",
}

_ROLE_TOKEN = re.compile(r"^(Q|K|V|Id)$")


@dataclass(frozen=True)
class ProjectionSpec:
    """Where each role comes from, plus the score term flag.

    ``source[r]`` is the index into ``projections`` of the learned projection role ``r`` reads,
    or ``IDENTITY``. ``projections`` lists, per distinct learned projection, the roles it serves
    (e.g. ``("k", "v")`` for a shared key/value projection), in fused-weight order.
    """

    source: tuple[int, int, int]
    projections: tuple[tuple[str, ...], ...]
    plus: bool = False

    @property
    def name(self) -> str:
        return format_scheme(self)

    def role_source(self, role: str) -> int:
        return self.source[ROLES.index(role)]

    def is_identity(self, role: str) -> bool:
        return self.role_source(role) == IDENTITY

    @property
    def identity_role(self) -> str | None:
        for role in ROLES:
            if self.is_identity(role):
                return role
        return None

    def shared(self, a: str, b: str) -> bool:
        """True when roles a and b read the same learned projection (the same tensor)."""
        sa, sb = self.role_source(a), self.role_source(b)
        return sa == sb and sa != IDENTITY

    def projection_is_query_shaped(self, index: int) -> bool:
        """A projection that feeds the query has n_head heads; key/value-only ones kv_heads."""
        return "q" in self.projections[index]

    def cached_sources(self) -> tuple[int, ...]:
        """The distinct tensors a KV cache must hold: the sources of k and v, deduplicated.
        (An identity key is still an input-dependent tensor and is cached.)"""
        out: list[int] = []
        for role in ("k", "v"):
            s = self.role_source(role)
            if s not in out:
                out.append(s)
        return tuple(out)


def parse_scheme(text: str) -> ProjectionSpec:
    """Parse the papers' notation. Raises UserError with a one-line reason."""
    if not isinstance(text, str):
        raise UserError(f"attention scheme {text!r} must be a string like Q-K-V")
    return _parse(text)


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> ProjectionSpec:
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"attention scheme {text!r} is empty; use e.g. Q-K-V, Id-K-V, Q-K=V, (Q=K-V)+")
    raw = text.strip().replace(" ", "")
    plus = False
    body = raw
    if body.endswith("+"):
        plus, body = True, body[:-1]
        if body.startswith("(") and body.endswith(")"):
            body = body[1:-1]
    if "(" in body or ")" in body or "+" in body:
        raise UserError(f"attention scheme {text!r} is malformed; the '+' form is written (Q=K-V)+ or Q=K-V+")
    # Tokenise into roles and separators, keeping which separator joined each pair.
    tokens = re.split(r"([-=])", body)
    names, seps = tokens[0::2], tokens[1::2]
    if len(names) != 3:
        raise UserError(
            f"attention scheme {text!r} must name three roles (query, key, value) joined by '-' or '=', "
            "e.g. Q-K-V, Id-K-V, Q-K=V"
        )
    for i, name in enumerate(names):
        norm = name if name == "Id" else name.upper()
        if norm in ("ID", "I"):
            norm = "Id"
        if not _ROLE_TOKEN.match(norm):
            raise UserError(f"attention scheme {text!r}: role {name!r} is not one of Q, K, V, Id")
        names[i] = norm
    # Roles go in the order Q, K, V, except Q=V-K (query and value share, key apart): the one pairing
    # that cannot be written with adjacent roles. order[t] is the role index of token t.
    order = [0, 2, 1] if names[1] == "V" and names[0] == "Q" and seps == ["=", "-"] else [0, 1, 2]
    for pos, name in enumerate(names):
        role = "QKV"[order[pos]]
        if name not in ("Id", role):
            raise UserError(
                f"attention scheme {text!r}: position {pos + 1} is the {ROLES[order[pos]]} role, write {role} or Id "
                "there (roles go in the order Q, K, V; Q=V-K shares the query and value projections)"
            )
    n_identity = names.count("Id")
    if n_identity > 1:
        raise UserError(
            f"attention scheme {text!r} has {n_identity} identity roles; at most one projection can be "
            "removed by a change of basis (use one Id)"
        )
    source, projections = _group(text, names, seps, order)
    return ProjectionSpec(source=source, projections=projections, plus=plus)


def _group(text: str, names: list[str], seps: list[str], order: list[int]):
    """(source per role, projections) from the role tokens: '=' continues the current group."""
    groups: list[list[int]] = [[0]]
    for i, sep in enumerate(seps):
        if sep == "=":
            groups[-1].append(i + 1)
        else:
            groups.append([i + 1])
    source = [0, 0, 0]
    projections: list[tuple[str, ...]] = []
    for tokens in groups:
        group = sorted(order[t] for t in tokens)
        if any(names[t] == "Id" for t in tokens):
            if len(group) > 1:
                raise UserError(
                    f"attention scheme {text!r}: the identity cannot be shared with another role "
                    "(Id=K would make the key the identity too); write e.g. Id-K=V"
                )
            source[group[0]] = IDENTITY
            continue
        projections.append(tuple(ROLES[i] for i in group))
        for i in group:
            source[i] = len(projections) - 1
    return tuple(source), tuple(projections)


def format_scheme(spec: ProjectionSpec) -> str:
    """Canonical notation, e.g. ``Id-K=V``, ``Q=V-K`` or ``(Q=K-V)+``: one spelling per spec."""
    q, k, v = spec.source
    if q == v != IDENTITY and k != q:
        body = "Q=V-" + ("Id" if k == IDENTITY else "K")
        return f"({body})+" if spec.plus else body
    parts = []
    for i, role in enumerate(ROLES):
        parts.append("Id" if spec.source[i] == IDENTITY else role.upper())
        if i < 2:
            same = spec.source[i] != IDENTITY and spec.source[i] == spec.source[i + 1]
            parts.append("=" if same else "-")
    body = "".join(parts)
    return f"({body})+" if spec.plus else body


def validate_heads(spec: ProjectionSpec, *, d_model: int, n_head: int, d_head: int, kv_heads: int) -> None:
    """Refuse head layouts that make no sense for a scheme, with one-line reasons."""
    scheme = spec.name
    if n_head <= 0 or d_head <= 0 or d_model <= 0:
        raise UserError(f"n_head={n_head}, d_head={d_head}, d_model={d_model} must all be positive")
    if kv_heads <= 0 or n_head % kv_heads:
        raise UserError(f"kv_heads={kv_heads} must divide n_head={n_head} (allowed: a divisor of {n_head})")
    ident = spec.identity_role
    if ident is not None and n_head * d_head != d_model:
        raise UserError(
            f"{scheme}: an identity {ident} needs n_head*d_head == d_model, got {n_head}*{d_head} != {d_model}"
        )
    if ident in ("k", "v") and kv_heads != n_head:
        raise UserError(
            f"{scheme}: an identity {ident} reads all n_head={n_head} input slices, so kv_heads must be "
            f"{n_head}, got {kv_heads}"
        )
    if kv_heads != n_head:
        for proj in spec.projections:
            if "q" in proj and len(proj) > 1:
                others = " and ".join({"k": "key", "v": "value"}[r] for r in proj if r != "q")
                raise UserError(
                    f"{scheme}: one projection serves the query ({n_head} heads) and the {others}, so "
                    f"kv_heads must equal n_head={n_head}, got {kv_heads}"
                )


# ---- key/value heads: one notation for variants (Q-K=V/MQA) and per-layer entries (Q-K=V/MQA@-4:) --
# MQA: 1 kv head; GQA-g: g kv heads; MHA: as many as the query heads. Written canonically as MQA or
# GQA-g; read also as GQAg or a bare count g (what per-layer strings and config.json files wrote
# before: 'Q-K=V/2'), in any letter case. A count is unambiguous: no other option is a number.
KV_HEADS_FORMS = "MQA, GQA-g, MHA or a count g >= 1"
_KV_HEADS = re.compile(r"^(?:(MQA)|(MHA)|GQA-?(\d+)|(\d+))$", re.IGNORECASE)


def is_kv_heads(text: str) -> bool:
    """True when `text` is written as a kv-head option (it may still be refused: GQA-0)."""
    return bool(_KV_HEADS.match(text.strip()))


def parse_kv_heads(text: str, n_head: int | None = None) -> int | None:
    """'MQA' -> 1, 'GQA-4' / 'GQA4' / '4' -> 4, 'MHA' -> n_head (None when n_head is not given: as
    many as the query heads, the default). Anything else is a UserError naming the forms."""
    m = _KV_HEADS.match(text.strip())
    if not m:
        raise UserError(f"kv heads {text.strip()!r} must be {KV_HEADS_FORMS}")
    mqa, mha, g, count = m.groups()
    if mqa:
        return 1
    if mha:
        return n_head
    kv = int(g or count)
    if kv < 1:
        raise UserError(f"kv heads {text.strip()!r} must be {KV_HEADS_FORMS}")
    return kv


def format_kv_heads(kv: int, n_head: int | None = None) -> str:
    """The canonical spelling: 1 -> 'MQA', g -> 'GQA-g', and 'MHA' when kv == n_head is given
    (parse_kv_heads(format_kv_heads(kv, n), n) == kv)."""
    if kv == n_head:
        return "MHA"
    return "MQA" if kv == 1 else f"GQA-{kv}"


# ---- per-layer schemes -------------------------------------------------------------------------
# ModelConfig.layers gives layers their own scheme and kv heads over the base (attn, kv_heads):
#   overrides  "ENTRY@SEL; ENTRY@SEL"     later overrides win, unnamed layers keep the base
#   list       "ENTRY|ENTRY|...|ENTRY"    one entry per layer
# ENTRY is SCHEME[/KV] (KV as above: MQA, GQA-g, MHA = n_head or a count; an empty SCHEME keeps
# the base scheme, e.g. "/MQA@-4:"). SEL is a comma list of layer indices (negative: from the end),
# slices "a:b[:s]" as in Python, and "everyK" (layers K-1, 2K-1, ...: every K-th layer counting
# from 1, as Gemma places its global layers). Examples: "Q-K=V@every4", "Q-K=V@0,5,7",
# "Q-K=V/MQA@-4:", "Q-K-V|Q-K=V|Q-K=V/GQA-2|Q-K-V".
_INT = re.compile(r"^-?\d+$")
_SLICE = re.compile(r"^(-?\d*):(-?\d*)(?::(\d*))?$")
_EVERY = re.compile(r"^every(\d+)$")


def _layer_entry(text: str, entry: str, n_head: int) -> tuple[str | None, int | None, bool]:
    """'Q-K=V/GQA-2' -> ('Q-K=V', 2, True); an empty scheme -> None; no '/' -> kv unchanged (False)."""
    scheme, slash, kv = entry.partition("/")
    scheme = scheme.strip() or None
    if scheme is not None:
        scheme = parse_scheme(scheme).name
    if not slash:
        return scheme, None, False
    try:
        return scheme, parse_kv_heads(kv, n_head), True
    except UserError as e:
        raise UserError(f"layers {text!r}: {e}") from None


def select_layers(sel: str, n_layer: int, text: str | None = None) -> list[int]:
    """The layers a selection SEL names ('every4', '0,5,7', '-4:'), in order, without repeats."""
    text = sel if text is None else text
    out: list[int] = []
    for item in sel.split(","):
        item = item.strip()
        if _INT.match(item):
            i = int(item)
            if not -n_layer <= i < n_layer:
                raise UserError(f"layers {text!r}: layer {i} is out of range for n_layer={n_layer}")
            out.append(i % n_layer)
        elif m := _SLICE.match(item):
            a, b, s = (int(g) if g else None for g in m.groups())
            if s == 0:
                raise UserError(f"layers {text!r}: slice {item!r} has step 0")
            if any(x is not None and not -n_layer <= x <= n_layer for x in (a, b)):  # Python would clamp silently
                raise UserError(f"layers {text!r}: slice {item!r} reaches past the model's {n_layer} layers")
            out.extend(range(n_layer)[slice(a, b, s)])
        elif m := _EVERY.match(item):
            k = int(m.group(1))
            if k <= 0:
                raise UserError(f"layers {text!r}: every{k} needs a positive K")
            out.extend(range(k - 1, n_layer, k))
        else:
            raise UserError(f"layers {text!r}: selection {item!r} is not a layer index, a slice a:b[:s] or everyK")
    if not out:
        raise UserError(f"layers {text!r}: selection {sel!r} names no layer of {n_layer}")
    return list(dict.fromkeys(out))


def parse_layers(
    text: str, *, n_layer: int, n_head: int, attn: str, kv_heads: int | None
) -> tuple[tuple[str, int | None], ...]:
    """The per-layer (scheme, kv_heads) table of a ModelConfig.layers string (notation above)."""
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"layers {text!r} is empty; use e.g. 'Q-K=V@every4' or 'Q-K-V|Q-K=V'")
    base = (parse_scheme(attn).name, kv_heads)
    table = [base] * n_layer
    body = text.strip()
    if "@" not in body:
        entries = body.split("|")
        if len(entries) != n_layer:
            raise UserError(
                f"layers {text!r} lists {len(entries)} layers, the model has n_layer={n_layer} "
                "(give one ENTRY per layer joined by '|', or overrides ENTRY@SEL)"
            )
        for i, entry in enumerate(entries):
            scheme, kv, has_kv = _layer_entry(text, entry, n_head)
            table[i] = (scheme or base[0], kv if has_kv else base[1])
        return tuple(table)
    if "|" in body:
        raise UserError(f"layers {text!r} mixes a '|' list with '@' overrides; use one form")
    for part in body.split(";"):
        entry, at, sel = part.partition("@")
        if not at or not sel.strip():
            raise UserError(f"layers {text!r}: override {part.strip()!r} must be ENTRY@SEL, e.g. Q-K=V@every4")
        scheme, kv, has_kv = _layer_entry(text, entry, n_head)
        if scheme is None and not has_kv:
            raise UserError(f"layers {text!r}: override {part.strip()!r} names neither a scheme nor kv heads")
        for i in select_layers(sel, n_layer, text):
            table[i] = (scheme or table[i][0], kv if has_kv else table[i][1])
    return tuple(table)


def format_layers(table: tuple[tuple[str, int | None], ...], base: tuple[str, int | None] | None = None) -> str:
    """A per-layer table as notation: overrides of `base` ("Q-K=V/GQA-3@0,1,16"), or the '|' list."""

    def entry(scheme: str, kv: int | None) -> str:
        return scheme if kv is None else f"{scheme}/{format_kv_heads(kv)}"

    if base is None:
        return "|".join(entry(*t) for t in table)
    groups: dict[tuple[str, int | None], list[int]] = {}
    for i, t in enumerate(table):
        if t != base:
            groups.setdefault(t, []).append(i)
    if not groups:
        raise ValueError("every layer has the base scheme: no per-layer notation needed")
    return "; ".join(f"{entry(*t)}@{','.join(map(str, idx))}" for t, idx in groups.items())
