"""Run by test_gpu_ready under `torchrun --nproc-per-node 2`: every scheme trained 2 steps with FSDP2
on gloo, each rank on its half of the batch; rank 0 trains an unsharded copy on the whole batch and
prints the largest loss or weight difference per scheme as one JSON line. Also: full state
on rank 0 only, and a sharded model loaded from rank 0's dicts alone.

A rank leaves with os._exit once its work is done and the group torn down: in torch 2.13 gloo's
threads (its TCP event loop, its work loops) outlive destroy_process_group in an FSDP process (the
group's shutdown() is a no-op and FSDP2/DeviceMesh keep references to it that survive the model), so
a normal exit runs the interpreter's and C++'s teardown beside them, while the peer closes its
sockets. os._exit ends the process, threads included, without that teardown
(scripts/repro_fsdp_gloo.py shows the threads)."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT
from qkvlab.train import distributed as D
from qkvlab.train.optim import make_optimizer


def main(schemes: list[str]) -> None:
    torch.set_num_threads(1)
    env = D.setup("cpu", timeout_s=120)  # a wedged peer fails the test well inside its 300 s
    diffs = {}
    for scheme in schemes:
        cfg = ModelConfig(attn=scheme, n_layer=2, n_head=4, d_model=32, vocab_size=64, context=16, bias=True)
        torch.manual_seed(0)
        model = GPT(cfg.validate()).double()  # float64: a sharding bug, not summation order, would show
        ref = copy.deepcopy(model)
        D.shard(model, env)
        opt = make_optimizer(model, 1e-2, 0.1, (0.9, 0.95), env.device)
        ref_opt = make_optimizer(ref, 1e-2, 0.1, (0.9, 0.95), env.device)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(2):
            x = torch.randint(0, 64, (4, 13), generator=g)
            half = x[2 * env.rank : 2 * env.rank + 2]
            loss = model(half[:, :-1], half[:, 1:])[1]
            loss.backward()  # FSDP averages gradients over ranks
            opt.step()
            opt.zero_grad()
            ref_loss = ref(x[:, :-1], x[:, 1:])[1]
            losses.append(abs(D.mean(env, loss.detach()).item() - ref_loss.item()))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        weights, optim = D.full_state(model, opt, sharded=True)
        assert env.main or (not weights and not optim.get("state")), "full state on a non-main rank"
        # resume at this world size from rank 0's dicts alone (the others read nothing)
        torch.manual_seed(1)
        fresh = D.shard(GPT(cfg.validate()).double(), env)
        fresh_opt = make_optimizer(fresh, 1e-2, 0.1, (0.9, 0.95), env.device)
        loaded = (weights, optim) if env.main else ({}, {})
        D.load_full_state(fresh, fresh_opt, *loaded, sharded=True, from_rank0=True)
        again, again_optim = D.full_state(fresh, fresh_opt, sharded=True)
        if env.main:
            ref_w = ref.state_dict()
            diffs[scheme] = max(max(losses), *((weights[k] - ref_w[k]).abs().max().item() for k in ref_w))
            assert all(torch.equal(weights[k], again[k]) for k in weights)
            assert json.dumps(optim["param_groups"]) == json.dumps(again_optim["param_groups"])  # betas: tuple or list
            assert optim["state"].keys() == again_optim["state"].keys()
            for n, st in optim["state"].items():
                assert all(torch.equal(v, again_optim["state"][n][k]) for k, v in st.items()), (
                    n,
                    st,
                    again_optim["state"][n],
                )
    if env.main:
        print(json.dumps(diffs))
    D.teardown(env)


if __name__ == "__main__":
    main(sys.argv[1:])  # an exception ends the rank the usual way (traceback, exit 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
