"""One dtype vocabulary and one device resolver: every --dtype option offers every spelling of the
dtypes it allows (float32 wherever fp32, ...), and every command resolves a bare "cuda" alike."""

from __future__ import annotations

import pytest
import torch

from qkvlab.base.devices import (
    COMPILE_CHOICES,
    DTYPE_ALIASES,
    DTYPES,
    compile_mode,
    dtype_choices,
    dtype_name,
    select_device,
)
from qkvlab.base.errors import UserError
from qkvlab.cli import COMMANDS, build_parser


def _dtype_options():
    for name in COMMANDS:
        sub = build_parser(name)._subparsers._group_actions[0].choices[name]
        for action in sub._actions:
            if "--dtype" in action.option_strings:
                yield name, action


def test_every_dtype_option_offers_every_spelling():
    seen = list(_dtype_options())
    assert {name for name, _ in seen} >= {"train", "generate", "convert", "info", "bench", "retrofit", "serve"}
    for name, action in seen:
        choices = set(action.choices)
        shorts = {dtype_name(c) for c in choices if c != "auto"}
        assert shorts <= set(DTYPES), name
        longs = {long for long, short in DTYPE_ALIASES.items() if short in shorts}
        assert shorts | longs <= choices, f"{name} --dtype misses {sorted((shorts | longs) - choices)}"
        assert choices == set(dtype_choices(tuple(shorts), auto="auto" in choices)), name  # nothing else


def test_every_decode_compile_option_is_one_spelling():
    """generate, bench and serve: --compile [auto|off|MODE], the bare flag meaning default."""
    seen = {}
    for name in COMMANDS:
        sub = build_parser(name)._subparsers._group_actions[0].choices[name]
        for action in sub._actions:
            if "--compile" in action.option_strings and name != "train":  # train's compiles the model
                seen[name] = action
    assert set(seen) == {"generate", "bench", "serve"}
    for name, action in seen.items():
        assert tuple(action.choices) == COMPILE_CHOICES and action.const == "default" and action.nargs == "?", name


def test_compile_mode_resolves_auto_per_device_and_refuses_cuda_graphs_for_changing_shapes():
    assert compile_mode("auto", "cpu") is None and compile_mode("off", "cuda") is None
    assert compile_mode("auto", "cuda") == "reduce-overhead"
    assert compile_mode("auto", "cuda", paged=True) is None  # serve: not measured where it pays
    assert compile_mode("max-autotune", "cpu", paged=True) == "max-autotune"
    with pytest.raises(UserError, match="reduce-overhead.*needs fixed shapes"):
        compile_mode("reduce-overhead", "cuda", paged=True)
    with pytest.raises(UserError, match="--compile 'fast' is not allowed; use one of auto, off, default"):
        compile_mode("fast", "cpu")


def test_info_takes_the_long_dtype_names(capsys):
    from qkvlab.cli import main

    for dtype, per_token in (("float32", "1,024 B"), ("bfloat16", "512 B"), ("fp16", "512 B")):
        assert main(["info", "--preset", "tiny", "--dtype", dtype]) == 0
        assert per_token in capsys.readouterr().out


@pytest.mark.parametrize("requested", ["cuda", "auto"])
def test_a_bare_cuda_is_one_device_everywhere(requested):
    """Single process: cuda:0; under torchrun: cuda:LOCAL_RANK. Never an index-less "cuda"."""
    assert select_device(requested, cuda_count=2) == torch.device("cuda", 0)
    assert select_device(requested, local_rank=1, world=2, cuda_count=2) == torch.device("cuda", 1)
    if requested == "auto" or torch.cuda.is_available():  # cuda_count=None: as torch sees this machine
        assert select_device(requested).type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_device_refusals_are_one_line():
    for bad, needle in (("gpu", "device='gpu'"), ("cuda:x", "device='cuda:x'")):
        with pytest.raises(UserError, match=needle):
            select_device(bad, cuda_count=1)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            select_device("cuda")


HELD_VS_GLIBC = """
import resource, sys, torch
from qkvlab.model.config import ModelConfig
from qkvlab.base.heap import hold_freed_memory
from qkvlab.model.transformer import GPT
if sys.argv[1] == "hold" and not hold_freed_memory():
    sys.exit(3)
torch.manual_seed(0)
model = GPT(ModelConfig(n_layer=2, n_head=4, d_model=64, context=128, vocab_size=8192, bias=False).validate())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 8192, (16, 129))  # logits of 16 x 128 x 8192 floats: 64 MiB, above glibc's largest mmap threshold
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(loss.item().hex(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.fixture(scope="module")
def held_vs_glibc() -> dict[str, list[tuple[str, int]]]:
    """Six training steps in a fresh process with the heap held and in one without: (loss as hex, page
    faults) per step."""
    import subprocess
    import sys

    out = {}
    for way in ("hold", "glibc"):
        run = subprocess.run([sys.executable, "-c", HELD_VS_GLIBC, way], capture_output=True, text=True, timeout=300)
        if run.returncode == 3:
            pytest.skip("not glibc: the heap is left as it is")
        assert run.returncode == 0, run.stderr
        out[way] = [(loss, int(faults)) for loss, faults in (line.split() for line in run.stdout.splitlines())]
    return out


def test_held_heap_reuses_freed_pages_instead_of_faulting_in_new_ones(held_vs_glibc):
    """qkvlab.base.heap: a step's 64 MiB logits and their gradient (above glibc's largest dynamic mmap
    threshold, so by default a fresh mapping every step, ~66k faults) come back from the held heap.
    Not every step reuses: a small block left above a freed one can make the heap grow past it
    (16k-49k faults some steps), so the test counts the best step and the total after warm-up."""
    import resource

    held = [faults for _, faults in held_vs_glibc["hold"][2:]]
    glibc = [faults for _, faults in held_vs_glibc["glibc"][2:]]
    pages = (64 << 20) // resource.getpagesize()
    assert min(glibc) >= pages  # glibc's defaults: at least every page of the logits, every step
    assert min(held) < pages // 20 and sum(held) < sum(glibc) / 2


def test_the_held_heap_changes_no_number(held_vs_glibc):
    """The same losses to the last bit held or not (PyTorch aligns every block to 64 bytes either way,
    so no kernel sees other data)."""
    losses = [[loss for loss, _ in held_vs_glibc[way]] for way in ("hold", "glibc")]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
