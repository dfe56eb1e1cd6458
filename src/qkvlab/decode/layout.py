"""How a decode step reads its Linear weights on the CPU: the layouts, their products, the decode-time
module tree that holds them, and the layout chosen by measurement.

Why: a one-token step is a chain of matrix-vector products bound by memory, and MKL runs a one-row
product on one thread whatever torch.get_num_threads() says. Splitting each weight into one block
per thread and multiplying them with one `bmm` puts every thread to work: SmolLM2's 151 products of
a step (538 MB fp32, streamed from memory as in a real step) took 33.9 ms as stored, 17.5 ms as
column blocks and 14.6 ms as row blocks on 2 threads (benchmarks/linear_layouts.py, docs/results/speed).

The layouts (LAYOUTS): "stored" (the weights as they are), "rows" and "columns" (`PackedProduct`'s
block orders, one block per thread), "kmajor" (the whole weight K-major, one block). The default
follows the batch (`default_layout`: whole SmolLM2 fp32 decode steps, 2 threads,
benchmarks/block_orders.py: row blocks 1.12-1.29x column blocks at 1 row, 1.4x at 2-4, 0.96-1.00x at
8, 0.89-0.92x at 16). A model whose Linear weights reach LAYOUT_PROBE_MIN_BYTES (a real model, its
weights streamed from memory each step) gets its layout by timing on this machine instead
(`choose_layout`, through qkvlab.base.measured): row blocks were chosen on an avx512_bf16 EPYC where
they ran 2.33x the weights as stored at one row, and ran 0.39x on a Xeon with AMX, where "kmajor" ran
1.14x (docs/results/speed). Below that size the weights sit in cache and the default decides.

Only CPU fp32/fp64 weights are laid out (bf16's own matrix-vector product is the faster as it is:
SmolLM2's 151 products 14.7 ms as stored, 20.7 ms as blocks), and only up to LAYOUT_MAX_BATCH rows.

`packed_model` gives the decode-time tree: a new module tree whose Linears compute their products
from the blocks, sharing every parameter, buffer and other module with the model; the model itself
is never changed. Outputs equal F.linear's to rounding (the same dot products; fp64 tests hold them
within 1e-12). It costs one copy of every Linear weight while the tree lives (SmolLM2-135M fp32: 538 MB).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn

from qkvlab.base.devices import DTYPE_BYTES, torch_dtype
from qkvlab.base.errors import UserError
from qkvlab.base.measured import Measured, Timer, Ways, decide

LAYOUTS = ("stored", "rows", "columns", "kmajor")
LAYOUT_DTYPES = ("fp32", "fp64")  # bf16's own matrix-vector product is the faster one as it is
# Rows a decode step packs for: SmolLM2's products on 2 threads as blocks vs as stored 2.14x at 1 row,
# 2.06x at 4, 1.35-1.44x at 16 (benchmarks/linear_layouts.py); 1.27x / 1.18x at 32 / 64 rows, but whole
# steps there are not measured
LAYOUT_MAX_BATCH = 16
LAYOUT_ROWS_MAX_BATCH = 4  # the default block order: "rows" up to this many rows, "columns" above
LAYOUT_PROBE_MIN_BYTES = 64 << 20  # Linear weights from which the layout is timed on the machine
LAYOUT_PROBE_BYTES = 128 << 20  # the weights timed: past the last-level cache, as in a real step


class PackedProduct:
    """A Linear's product for a few rows at a time on the CPU: its weight (N, K) split into `parts`
    blocks of output rows, multiplied by one `bmm` whose batch the CPU threads share. `order` "rows"
    keeps each block as stored, (parts, N/parts, K), and computes W_p x (a dot product per output,
    reading each weight row once); "columns" stores it K-major, (parts, K, N/parts), and computes
    x W_p^T. More rows than `max_rows` go to the Linear's own weight."""

    def __init__(self, linear: nn.Linear, parts: int, max_rows: int = LAYOUT_MAX_BATCH, order: str = "rows"):
        n, k = linear.weight.shape
        self.linear, self.max_rows, self.order = linear, max_rows, order
        self.parts = parts if parts > 0 and n % parts == 0 else 1
        w = linear.weight.detach().view(self.parts, n // self.parts, k)  # (P, N/P, K)
        if order == "rows":
            self.blocks = w.contiguous()
        elif order == "columns":
            self.blocks = w.transpose(1, 2).contiguous()  # (P, K, N/P)
        else:
            raise ValueError(f"order={order!r}: 'rows' or 'columns'")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        *lead, k = x.shape
        rows = x.reshape(-1, k)  # (R, K)
        if rows.shape[0] > self.max_rows:
            return nn.functional.linear(x, self.linear.weight, self.linear.bias)
        if self.order == "rows":
            y = torch.bmm(self.blocks, rows.t().expand(self.parts, -1, -1))  # (P, N/P, R)
            # (R, N) laid out row by row: a transposed view would carry stride R into q, k and v, and
            # SDPA's CPU flash kernel takes only a last dimension of stride 1 (else its slow math path)
            y = y.reshape(-1, rows.shape[0]).t().contiguous().view(*lead, -1)  # (..., N)
        else:
            y = torch.bmm(rows.expand(self.parts, -1, -1), self.blocks)  # (P, R, N/P)
            y = y.transpose(0, 1).reshape(*lead, -1)  # (..., N): block p's outputs at columns p*N/P onwards
        return y if self.linear.bias is None else y + self.linear.bias


class PackedLinear(nn.Module):
    """A Linear of the decode-time tree: the Linear's own weight and bias (the same Parameters, so
    code that reads `.weight` reads them), its product computed by `product` (a PackedProduct)."""

    def __init__(self, linear: nn.Linear, product: PackedProduct):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.product.order} x {self.product.parts}"


def default_layout(batch: int) -> str:
    """The layout fixed by measurement on one machine (LAYOUT_ROWS_MAX_BATCH): what small models use,
    and what `choose_layout` keeps unless another way wins by more than the noise."""
    return "rows" if batch <= LAYOUT_ROWS_MAX_BATCH else "columns"


def packed_product(linear: nn.Linear, layout: str, parts: int) -> Callable:
    """The product `layout` names for this Linear: "stored" its own forward, "kmajor" one K-major
    block, "rows"/"columns" one block per part in that order."""
    if layout == "stored":
        return linear.__call__
    return (
        PackedProduct(linear, 1, order="columns") if layout == "kmajor" else PackedProduct(linear, parts, order=layout)
    )


def packed_model(model: nn.Module, layout: str, parts: int) -> nn.Module:
    """`model` as a decode step in `layout` calls it: "stored" is the model itself; any other layout a
    new module tree whose every nn.Linear is a `PackedLinear` (blocks copied once, `parts` of them) and
    which shares every other module, parameter and buffer with `model`. `model` is never changed."""
    if layout not in LAYOUTS:
        raise UserError(f"decode layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "stored":
        return model
    done: dict[int, nn.Module] = {}  # a module reached twice is rebuilt once

    def rebuilt(module: nn.Module) -> nn.Module:
        if id(module) not in done:
            if isinstance(module, nn.Linear):
                done[id(module)] = PackedLinear(module, packed_product(module, layout, parts))
            else:
                children = {n: rebuilt(c) for n, c in module._modules.items() if c is not None}
                same = all(children[n] is module._modules[n] for n in children)
                clone = module if same else copy.copy(module)  # shares its parameters, buffers, hooks
                if not same:
                    clone.__dict__["_modules"] = {**module._modules, **children}
                done[id(module)] = clone
        return done[id(module)]

    return rebuilt(model)


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The (out, in) shape of every nn.Linear weight of `model`, in module order."""
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]


def layout_applies(device_type: str, dtype: str, batch: int) -> bool:
    """Whether a decode of `batch` rows in `dtype` on this device packs its weights at all."""
    return device_type == "cpu" and dtype in LAYOUT_DTYPES and batch <= LAYOUT_MAX_BATCH


def layout_probe(shapes: list[tuple[int, int]], dtype: str, batch: int, parts: int) -> tuple[str, list] | None:
    """(key, shapes timed) when weights of these shapes are timed for their layout, else None (below
    LAYOUT_PROBE_MIN_BYTES). The key names the rows, parts, dtype and the timed weights' shapes."""
    size = DTYPE_BYTES[dtype]
    if sum(n * k for n, k in shapes) * size < LAYOUT_PROBE_MIN_BYTES:
        return None
    timed, total = [], 0
    for n, k in shapes:
        if total >= LAYOUT_PROBE_BYTES:
            break
        timed.append((n, k))
        total += n * k * size
    kinds = ",".join(f"{n}x{k}" for n, k in dict.fromkeys(timed))
    name = str(torch_dtype(dtype)).removeprefix("torch.")
    rows = min(batch, LAYOUT_MAX_BATCH)
    return f"layout-{name}-cpu-r{rows}-p{parts}-{kinds}-n{len(timed)}", timed


def layout_ways(shapes: list[tuple[int, int]], dtype: str, rows: int, parts: int) -> Ways:
    """Each layout's call: the products of weights of these shapes for `rows` rows (the weights'
    values do not matter to the time; they are filled, not drawn)."""
    dt = torch_dtype(dtype)
    linears = []
    for n, k in shapes:
        lin = nn.Linear(k, n, bias=False, device="meta", dtype=dt).to_empty(device="cpu")
        lin.weight.requires_grad_(False).fill_(0.01)
        linears.append(lin)
    inputs = [torch.randn(rows, lin.in_features, dtype=dt) for lin in linears]
    ways = {layout: [packed_product(lin, layout, parts) for lin in linears] for layout in LAYOUTS}

    @torch.inference_mode()
    def products(way: list[Callable]) -> None:
        for product, x in zip(way, inputs):
            product(x)

    return {layout: (lambda way=way: products(way)) for layout, way in ways.items()}


def choose_layout(
    shapes: list[tuple[int, int]],
    dtype: str,
    device_type: str,
    batch: int,
    parts: int,
    setting: str = "auto",
    *,
    timer: Timer = Timer(),
    cache=None,
) -> tuple[str, Measured | None]:
    """(layout, its measurement) for a decode of `batch` rows through Linear weights of these shapes:
    an explicit `setting` as it is; "auto": "stored" where no layout applies (`layout_applies`),
    `default_layout` below LAYOUT_PROBE_MIN_BYTES, else timed on this machine (measured.decide: the
    products of the first LAYOUT_PROBE_BYTES of weights each way, the default kept unless beaten)."""
    if setting != "auto":
        if setting not in LAYOUTS:
            raise UserError(f"decode layout {setting!r} is not one of auto, {', '.join(LAYOUTS)}")
        return setting, None
    if not layout_applies(device_type, dtype, batch):
        return "stored", None
    probe = layout_probe(shapes, dtype, batch, parts)
    if probe is None:
        return default_layout(batch), None
    key, timed = probe
    rows = min(batch, LAYOUT_MAX_BATCH)
    record = decide(key, default_layout(rows), lambda: layout_ways(timed, dtype, rows, parts), timer=timer, path=cache)
    return record.choice, record
