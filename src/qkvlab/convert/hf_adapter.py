"""A Hugging Face architecture as a state-dict adapter: a plain name map each way, as torchtitan's
`StateDictAdapter`s are, plus what names alone cannot say (the config, which tensors are stored
transposed, which HF tensors qkvlab fuses into one).

Names are templates: "{}" stands for the layer index ("model.layers.{}.input_layernorm.weight").
`from_hf` refuses an HF tensor the map has no place for, and `to_hf` a qkvlab tensor, by name: a
weight is never dropped silently. One adapter per architecture: hf_gpt2.py, hf_llama.py; adding a
family is one more such file (docs/extending.md).
"""

from __future__ import annotations

import re

import torch

from qkvlab.base.errors import UserError
from qkvlab.model.config import ModelConfig

_INDEX = re.compile(r"\.(\d+)\.")


def template(name: str) -> tuple[str, str | None]:
    """'model.layers.3.mlp.up_proj.weight' -> ('model.layers.{}.mlp.up_proj.weight', '3')."""
    m = _INDEX.search(name)
    if m is None:
        return name, None
    return name[: m.start()] + ".{}." + name[m.end() :], m.group(1)


class StateDictAdapter:
    model_type: str = ""
    hf_class: str = ""  # the transformers class export builds
    from_hf_map: dict[str, str] = {}  # HF template -> qkvlab template, one tensor each
    fused: dict[str, tuple[str, ...]] = {}  # qkvlab template -> the HF templates concatenated (dim 0) into it
    transposed: frozenset[str] = frozenset()  # HF templates stored (in, out) (GPT-2's Conv1D)
    zero_when_missing: frozenset[str] = frozenset()  # HF templates exported as zeros when qkvlab has none
    export_needs: dict[str, tuple[str, ...]] = {}  # ModelConfig field -> the values this class can hold

    # ---- what each architecture says --------------------------------------------------------------
    def model_config(self, hf_config) -> ModelConfig:
        """The qkvlab config of an HF config (refusing what has no qkvlab value)."""
        raise NotImplementedError

    def hf_config(self, tf, cfg: ModelConfig, kv_heads: int):
        """The transformers config holding `cfg` (kv_heads: `export_kv_heads`)."""
        raise NotImplementedError

    def export_kv_heads(self, cfg: ModelConfig) -> int:
        """Key/value heads of the exported model; layers with fewer repeat theirs."""
        return cfg.n_head

    def check_export(self, cfg: ModelConfig, why: str) -> None:
        for key, allowed in self.export_needs.items():
            if getattr(cfg, key) not in allowed:
                raise UserError(f"{why}: {key}={getattr(cfg, key)} (that class needs {' or '.join(allowed)})")

    # ---- the maps -------------------------------------------------------------------------------
    def from_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF state -> qkvlab names (a tied head stays: the loader folds it, qkvlab.model.folder)."""
        parts = {hf: ours for ours, hfs in self.fused.items() for hf in hfs}
        st: dict[str, torch.Tensor] = {}
        found: dict[tuple[str, str | None], dict[str, torch.Tensor]] = {}
        for name, t in sd.items():
            tpl, layer = template(name)
            t = t.T.contiguous() if tpl in self.transposed else t
            if tpl in self.from_hf_map:
                st[_fill(self.from_hf_map[tpl], layer)] = t
            elif tpl in parts:
                found.setdefault((parts[tpl], layer), {})[tpl] = t
            else:
                raise UserError(f"{self.model_type} tensor {name}: qkvlab has no place for it")
        for (ours, layer), got in found.items():
            missing = [hf for hf in self.fused[ours] if hf not in got]
            if missing:
                raise UserError(f"{self.model_type} checkpoint has no {_fill(missing[0], layer)}")
            st[_fill(ours, layer)] = torch.cat([got[hf] for hf in self.fused[ours]], 0)
        return st

    def to_hf(self, st: dict[str, torch.Tensor], widths: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """qkvlab state (every layer explicit, projections Q-K-V) -> HF names; widths: the rows of
        each fused part (query, key, value)."""
        inverse = {ours: hf for hf, ours in self.from_hf_map.items()}
        out: dict[str, torch.Tensor] = {}
        for name, t in st.items():
            tpl, layer = template(name)
            if tpl in inverse:
                hf = inverse[tpl]
                out[_fill(hf, layer)] = t.T.contiguous() if hf in self.transposed else t
            elif tpl in self.fused:
                for hf, part in zip(self.fused[tpl], t.split(widths, 0), strict=True):
                    out[_fill(hf, layer)] = part.T.contiguous() if hf in self.transposed else part.clone()
            else:  # a mapping bug (check_export refuses what the class cannot hold)
                raise RuntimeError(f"export to {self.model_type}: qkvlab tensor {name} has no place")
        return out

    def complete(
        self, out: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], device
    ) -> dict[str, torch.Tensor]:
        """Zeros (on `device`, the weights') for each HF tensor qkvlab has none of: biases (a bias-free
        qkvlab model) and `zero_when_missing` (GPT-2's positions for pos=none); anything else is a mapping bug."""
        for name, t in expected.items():
            if name not in out:
                if not (name.endswith(".bias") or template(name)[0] in self.zero_when_missing):
                    raise RuntimeError(f"export to {self.model_type}: no value for {name}")
                out[name] = torch.zeros_like(t, device=device)
        return out


def _fill(tpl: str, layer: str | None) -> str:
    return tpl if layer is None else tpl.replace("{}", layer, 1)
