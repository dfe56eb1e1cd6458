"""One dtype vocabulary, one device resolver and the sharding names, for every command.

dtype names: fp32, bf16, fp16, fp64 (also spelled float32, bfloat16, float16, float64), and "auto"
(bf16 on CUDA, fp32 elsewhere; training's autocast decides the CPU's by timing the model's shapes,
`qkvlab.decode.dtype_probe`, never from a CPU flag). An option's choices are
`dtype_choices(ALLOWED)`: every spelling of the dtypes it allows. Devices: auto, cpu, cuda, cuda:N,
mps; `select_device` is the one resolver (a bare "cuda" is always this process's cuda:LOCAL_RANK,
cuda:0 outside torchrun; an explicit cuda:N is refused with more than one rank). Decoding's
`--compile [MODE]` (generate, bench, serve): auto, off or a torch.compile mode, resolved by `compile_mode`.
"""

from __future__ import annotations

import os
import platform
import re
from typing import Any

from qkvlab.base.errors import UserError
from qkvlab.base.settings import setting

# function-level imports: startup: torch is imported inside the functions that use it, so importing this
# module stays torch-free (`qkvlab serve` checks its options before it loads torch).

DTYPES = ("fp32", "bf16", "fp16", "fp64")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
TRAIN_DTYPES = ("fp32", "bf16")  # autocast dtypes (fp16 would need a grad scaler)
INFERENCE_DTYPES = ("fp32", "bf16", "fp16")  # generate, bench
EXACT_DTYPES = ("fp64", "fp32")  # convert: float64 for exact checks
SHARDINGS = ("ddp", "fsdp")  # train --sharding, info --memory
DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile modes; reduce-overhead: CUDA graphs
COMPILE_CHOICES = ("auto", "off", *COMPILE_MODES)  # --compile's values in generate, bench and serve
PAGED_COMPILE_MODES = ("default", "max-autotune")  # serve's paged step changes shape: no CUDA graphs


def dtype_choices(allowed: tuple[str, ...] = DTYPES, *, auto: bool = True) -> tuple[str, ...]:
    """Every spelling an option accepts for `allowed`: auto (unless auto=False), the short names,
    then their long aliases (float32, bfloat16, ...)."""
    longs = tuple(long for long, short in DTYPE_ALIASES.items() if short in allowed)
    return (("auto",) if auto else ()) + tuple(allowed) + longs


def dtype_name(name: str, *, device_type: str = "cpu", allowed: tuple[str, ...] = DTYPES) -> str:
    """Canonical short name of a dtype spelling; "auto" -> bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    short = DTYPE_ALIASES.get(name, name)
    if short not in allowed:
        raise UserError(f"dtype={name!r} is not allowed; use auto or one of {', '.join(allowed)}")
    return short


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has native bf16 dot products (AVX512-BF16 or AMX): a description of the
    machine, not a speed policy (AVX512-BF16 alone can make bf16 autocast slower than fp32; `auto`
    is decided by qkvlab.decode.dtype_probe's timing). Reads /proc/cpuinfo's flags (or `cpuinfo`),
    else torch's capability string (AMX only)."""
    cpuinfo = _cpuinfo() if cpuinfo is None else cpuinfo
    flags = {w for line in cpuinfo.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    if flags:
        return any(f in flags for f in BF16_CPU_FLAGS)
    try:
        import torch

        return "AMX" in torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        return False


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def check_dtype(name: str, allowed: tuple[str, ...] = DTYPES) -> str:
    """`name` unchanged if it is auto or an allowed spelling (configs keep what the user wrote)."""
    if name != "auto":
        dtype_name(name, allowed=allowed)
    return name


def torch_dtype(name: str, device_type: str = "cpu"):
    """The torch dtype of a name ("auto" as `dtype_name`; training's auto: qkvlab.decode.dtype_probe)."""
    import torch

    short = dtype_name(name, device_type=device_type)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[short]


def check_device(name: str) -> str:
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise UserError(f"device={name!r} is not allowed; use {DEVICE_HELP}")
    return name


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them in the environment; (0, 1, 0) outside it.
    Readable before any process group exists (a command's rank-0-only lines)."""
    env = os.environ
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))


def select_device(requested: str = "auto", local_rank: int = 0, world: int = 1, cuda_count: int | None = None):
    """The one device resolver: the torch.device this process uses, always with an index when it is
    CUDA (set_device needs one, and "cuda" means the same device everywhere).

    requested: "auto", "cpu", "mps", "cuda" or "cuda:N". "auto" and "cuda" pick cuda:LOCAL_RANK (one
    process per GPU under torchrun; cuda:0 alone). cuda_count: visible CUDA devices (None: ask torch;
    0 without CUDA), so with every argument given it is pure (a torch.device is only a name)."""
    import torch

    check_device(requested)
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    dev = torch.device(("cuda" if cuda_count > 0 else "cpu") if requested == "auto" else requested)
    if dev.type != "cuda":
        return dev
    if cuda_count == 0:
        raise UserError(f"device={requested}: no CUDA device on this machine; use cpu or auto")
    if dev.index is not None and world > 1:
        raise UserError(
            f"device={requested} with {world} ranks would put every rank on one GPU; "
            "use --device cuda or auto (each rank takes cuda:LOCAL_RANK; CUDA_VISIBLE_DEVICES picks the GPUs)"
        )
    index = local_rank if dev.index is None else dev.index
    if index >= cuda_count:
        who = f"LOCAL_RANK={local_rank} of world size {world}" if dev.index is None else f"device={requested}"
        raise UserError(f"{who} needs cuda:{index} but only {cuda_count} CUDA device(s) are visible")
    return torch.device("cuda", index)


def inference_dtype_setting(
    help: str = "weights and cache dtype (auto: bf16 on GPU; on CPU bf16 or fp32, whichever a short timing of "
    "the model's decode step finds faster, cached per machine)",
) -> Any:
    """--dtype of the commands that decode (generate, serve, bench): INFERENCE_DTYPES or auto."""
    return setting("auto", help=help, choices=dtype_choices(INFERENCE_DTYPES))


def compile_setting(default: str, help: str) -> Any:
    """--compile [MODE], one spelling in generate, bench and serve: a torch.compile mode, off or auto
    (`compile_mode` resolves it); the bare flag means default."""
    return setting(default, help=help, choices=COMPILE_CHOICES, const="default")


def compile_mode(choice: str, device_type: str, *, paged: bool = False) -> str | None:
    """--compile's value (COMPILE_CHOICES) -> the torch.compile mode to decode with, None for eager.
    auto: CUDA graphs (reduce-overhead) for the static step on a GPU; eager on the CPU, where compiling
    takes longer than it saves in one run (docs/inference.md), and for the
    paged step (serve), whose changing shapes CUDA graphs cannot replay and whose compiled speed is
    measured on the CPU only."""
    if choice not in COMPILE_CHOICES:
        raise UserError(f"--compile {choice!r} is not allowed; use one of {', '.join(COMPILE_CHOICES)}")
    if choice == "auto":
        return "reduce-overhead" if device_type == "cuda" and not paged else None
    if choice == "off":
        return None
    if paged and choice not in PAGED_COMPILE_MODES:
        raise UserError(
            f"--compile {choice} (CUDA graphs) needs fixed shapes and serve's batch changes every step; "
            f"use {' or '.join(PAGED_COMPILE_MODES)}"
        )
    return choice
