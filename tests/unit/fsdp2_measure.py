# SPDX-License-Identifier: Apache-2.0
"""Record the collective call pattern of real FSDP2 (the fixtures of test_fsdp2_pattern.c).

Runs a small model under torch.distributed.fsdp.fully_shard on CPU/gloo with 2 ranks,
wraps FSDP2's foreach_all_gather / foreach_reduce and prints, per scenario, one line:
"AG group" / "RS group[params with a gradient]" per call, passes separated by "|".
Not part of the test suite (it needs torch and takes about a minute per scenario):

    /root/.cache/mfsdp/venv/bin/python tests/unit/fsdp2_measure.py default noprefetch \
        accum eval eval2 unused frozen frozen_block detached root_reshard \
        titan titan_old titan_eval titan_accum

Scenarios: a root (embed, norm, lm_head) and three blocks each wrapped with fully_shard,
FSDP2's defaults ("default"), without backward prefetch ("noprefetch", FSDP2's
_backward_prefetch patched out), gradient accumulation with set_requires_gradient_sync(False)
on the first micro-batch ("accum"), a no_grad eval forward after each step ("eval", twice:
"eval2"), an unused param in block 1 ("unused"), a frozen bias ("frozen"), a frozen block
("frozen_block"), a block whose output is detached ("detached"), the root with
reshard_after_forward=True ("root_reshard"); torchtitan's wrapping (embedding, blocks,
[norm, output] kept unsharded after forward, root without params: "titan"; the older default
that also keeps the last block: "titan_old"; with evals and accumulation: "titan_eval",
"titan_accum").
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

LOG = []


def wrap_collectives():
    ag0, rs0 = pg.foreach_all_gather, pg.foreach_reduce

    def ag(fsdp_params, *a, **k):
        LOG.append(("AG", tuple(p._param_fqn for p in fsdp_params)))
        return ag0(fsdp_params, *a, **k)

    def rs(fsdp_params, *a, **k):
        LOG.append(("RS", tuple(p._param_fqn for p in fsdp_params)))
        return rs0(fsdp_params, *a, **k)

    pg.foreach_all_gather, pg.foreach_reduce = ag, rs


class Block(nn.Module):
    detach = False

    def __init__(self, D, H, unused=False):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.extra = nn.Linear(D, D) if unused else None

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        return x + (y.detach() if self.detach else y)


class Model(nn.Module):
    def __init__(self, L=3, D=8, H=16, V=10, C=5, unused_block=None):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(D, H, unused=(l == unused_block)) for l in range(L)])
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, C)

    def forward(self, t):
        h = self.embed(t).mean(1)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(self.norm(h))


def label(names, groups):
    for gname, prefixes in groups:
        if any(names[0].startswith(p) for p in prefixes):
            return gname
    return "?" + names[0]


def run(rank, scenario):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    L = 3
    m = Model(L=L, unused_block=1 if scenario == "unused" else None)
    if scenario == "detached":
        m.blocks[1].detach = True
    if scenario == "frozen_block":
        for p in m.blocks[1].parameters():
            p.requires_grad_(False)
    if scenario == "frozen":
        m.blocks[1].fc1.bias.requires_grad_(False)
    if scenario == "noprefetch":
        pg.FSDPParamGroup._backward_prefetch = lambda self: None
    if scenario.startswith("titan"):
        fully_shard(m.embed)
        for l, b in enumerate(m.blocks):
            fully_shard(b, reshard_after_forward=(l < L - 1) if scenario == "titan_old" else True)
        fully_shard([m.norm, m.lm_head], reshard_after_forward=False)
        fully_shard(m)
        groups = ([("emb", ["embed."])] + [(f"b{l}", [f"blocks.{l}."]) for l in range(L)]
                  + [("out", ["norm.", "lm_head."])])
    else:
        for b in m.blocks:
            fully_shard(b)
        if scenario == "root_reshard":
            fully_shard(m, reshard_after_forward=True)
        else:
            fully_shard(m)
        groups = ([(f"b{l}", [f"blocks.{l}."]) for l in range(L)]
                  + [("root", ["embed.", "norm.", "lm_head."])])
    wrap_collectives()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    t = torch.randint(0, 10, (4, 3))
    y = torch.randn(4, 5)

    def step(sync=True):
        m.set_requires_gradient_sync(sync)
        loss = ((m(t) - y) ** 2).mean()
        loss.backward()

    def evaluate():
        LOG.append(("--", "eval"))
        with torch.no_grad():
            m(t)

    for it in range(2):
        LOG.append(("--", "step %d" % it))
        if scenario in ("accum", "titan_accum"):
            step(False)
            LOG.append(("--", "micro"))
        step(True)
        opt.step()
        opt.zero_grad()
        if scenario in ("eval", "titan_eval", "eval2"):
            evaluate()
        if scenario == "eval2":
            evaluate()
    if rank == 0:
        out = []
        for k, names in LOG:
            if k == "--":
                out.append("| " + names)
            elif k == "RS":
                out.append(f"RS {label(names, groups)}[{len(names)}]")
            else:
                out.append(f"AG {label(names, groups)}")
        print(scenario + ": " + " ".join(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    for sc in sys.argv[1:]:
        mp.spawn(run, args=(sc,), nprocs=2)
