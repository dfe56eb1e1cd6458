"""Data parallelism outside the model: torchrun env, DDP or FSDP2 wrapping, full-state checkpoints.

Launch: `torchrun --nproc-per-node N -m qkvlab train ...` (gloo on CPU, nccl on GPUs). Each rank
takes rows [r*B/W, (r+1)*B/W) of the step's global batch. Checkpoints hold full (gathered) state
dicts keyed by parameter names, so they load at any world size and with either sharding.
Multi-node runs need OUT on a shared filesystem (every rank reads the checkpoint).
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from qkvlab.base.devices import select_device, torchrun_env
from qkvlab.model.positions import is_legacy_key


@dataclass
class Env:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # we initialised the process group (so we tear it down)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def setup(device: str = "auto", timeout_s: float | None = None) -> Env:
    """Read torchrun's env vars; initialise the process group when WORLD_SIZE > 1 (timeout_s: the
    collectives' timeout, None = torch's default)."""
    rank, world, local_rank = torchrun_env()
    dev = select_device(device, local_rank, world)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    env = Env(rank, world, local_rank, dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo",
            device_id=dev if dev.type == "cuda" else None,
            timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s),
        )
        env.owns_group = True
    return env


def teardown(env: Env) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: Env) -> None:
    if env.distributed:
        dist.barrier()


def total(env: Env, value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (on the tensor's device: NCCL needs CUDA tensors)."""
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def mean(env: Env, value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (SUM then divide: gloo has no AVG)."""
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.world
    return value


def all_gather_object(env: Env, obj):
    if not env.distributed:
        return [obj]
    out = [None] * env.world
    dist.all_gather_object(out, obj)
    return out


def shard(model: nn.Module, env: Env, *, param_dtype: torch.dtype | None = None, compile: bool = False) -> nn.Module:
    """FSDP2: every element of every ModuleList (the transformer blocks) is its own unit, then the
    root (embeddings, head). Parameters become DTensors sharded over the ranks, in place.
    param_dtype (bf16, used with autocast in the same dtype as DDP is): the blocks' Linear weights and
    biases are all-gathered and computed in it, gradients reduced in fp32, the fp32 master copy
    sharded. Made to compute exactly what DDP + autocast computes (tested): the blocks' inputs are
    not cast (the residual stream stays fp32, as under autocast); the blocks' norms (their own small
    units) and the root (embeddings, final norm, head) are gathered in fp32, as autocast reads them
    (it casts the head's matmul to bf16 as under DDP). One difference remains: the "+" term's weights
    are gathered in bf16, so sum(w) (its score scale) is summed from bf16-rounded values (docs/gpu.md).
    compile: each block compiled before it is sharded (torchtitan's order: no graph breaks at the
    FSDP hooks between blocks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # startup: slow to import, FSDP only

    mesh = init_device_mesh(env.device.type, (env.world,))
    reduce = torch.float32 if param_dtype else None
    linear_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce, cast_forward_inputs=False)
    fp32_mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce, cast_forward_inputs=False)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                if compile:
                    block.compile()
                if param_dtype is not None:
                    for sub in _fp32_units(block):
                        fully_shard(sub, mesh=mesh, mp_policy=fp32_mp)
                fully_shard(block, mesh=mesh, mp_policy=linear_mp)
    fully_shard(model, mesh=mesh, mp_policy=fp32_mp)
    return model


def _fp32_units(block: nn.Module) -> list[nn.Module]:
    """A block's norms: autocast reads their parameters in fp32. (The "+" term's parameters stay in
    the block's unit: it is called through key_term, not forward, so FSDP's hooks would not gather
    it as a unit of its own.)"""
    return [
        m
        for m in block.modules()
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and any(True for _ in m.parameters(recurse=False))
    ]


def replicate(model: nn.Module, env: Env) -> nn.Module:
    """DDP. Buffers (rotary and score-term tables) are identical on every rank by construction:
    broadcasting them every step would only cost bandwidth."""
    return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None, broadcast_buffers=False)


@contextlib.contextmanager
def grad_sync(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if sync:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool = False, main: bool = True
) -> tuple[dict, dict]:
    """Full (gathered) state dicts on the CPU, the optimizer's keyed by parameter name:
    {"state": {name: {key: tensor}}, "param_groups": [{..., "params": [names]}]}, on the main rank
    only (the others get empty dicts: CPU memory is not multiplied by the ranks). Sharded (FSDP)
    models go through torch.distributed.checkpoint, one parameter gathered to rank 0 at a time (a
    collective: call on every rank); replicated and single-process ones take the direct route, same
    layout (tested), without DCP's import cost."""
    if sharded:
        # startup: torch.distributed.checkpoint's imports, for sharded (FSDP) models only
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full dicts on rank 0 only
        return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)
    if not main:
        return {}, {"state": {}, "param_groups": []}
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    names = _index_names(model, optimizer)
    osd = optimizer.state_dict()
    state = {
        names[i]: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for i, s in osd["state"].items()
    }
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    return weights, {"state": state, "param_groups": groups}


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights: dict,
    optim_state: dict | None,
    sharded: bool = False,
    from_rank0: bool = False,
) -> None:
    """Full state dicts (from any world size, either route) into a possibly sharded model.
    from_rank0 (sharded only): only rank 0 passes the dicts (the others pass empty ones and need
    not read the checkpoint); each tensor is broadcast and sharded in turn."""
    weights, optim_state = _without_legacy(weights, optim_state)
    if sharded:
        # startup: torch.distributed.checkpoint's imports, for sharded (FSDP) models only
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
        set_model_state_dict(model, weights, options=opts)
        if optimizer is not None and optim_state is not None:
            set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
        return
    model.load_state_dict(weights)
    if optimizer is not None and optim_state is not None:
        index = {n: i for i, n in _index_names(model, optimizer).items()}
        optimizer.load_state_dict(
            {
                "state": {index[n]: s for n, s in optim_state["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optim_state["param_groups"]],
            }
        )


def _without_legacy(weights: dict, optim_state: dict | None) -> tuple[dict, dict | None]:
    """Drop positions.LEGACY_KEYS (and their optimizer state) from a checkpoint's state dicts."""
    weights = {k: v for k, v in weights.items() if not is_legacy_key(k)}
    if optim_state:  # (empty on the ranks that load from rank 0)
        optim_state = {
            "state": {n: s for n, s in optim_state["state"].items() if not is_legacy_key(n)},
            "param_groups": [
                {**g, "params": [n for n in g["params"] if not is_legacy_key(n)]} for g in optim_state["param_groups"]
            ],
        }
    return weights, optim_state


def _index_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Optimizer state index -> parameter name (the first name of a shared parameter)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: names[id(p)] for i, p in enumerate(order)}
