#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: every refusal of the companion inside a real FSDP2 job (`check.py errors`).

Run under mpirun at 4 ranks (gloo, no adapter; resharding to a smaller group after forward
needs a factor of the world size between 1 and it) or at 1 rank (the world-size-1 cases).
The companion is installed with a stand-in shim that accepts everything, so each case
reaches the companion's own check; each builds a fresh FSDP2 model and must raise the
expected error with the expected words. Prints "errors: N cases ok" at the end.
"""
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from mfsdp import companion  # noqa: E402
from mfsdp.manifest import ManifestError  # noqa: E402


class AcceptingShim:
    def __init__(self):
        self.n = 0

    def register(self, manifest_json):
        self.n += 1
        return self.n - 1

    def tag(self, *a):
        pass

    def untag(self):
        pass

    def tag_pending(self):
        return False

    def step(self, *a):
        pass

    def grad_sqnorm(self, handle):
        return 0.0

    def scale_grads(self, *a):
        pass

    def zero_grads(self, handle):
        self.zeroed = getattr(self, "zeroed", []) + [handle]

    def reload(self, handle):
        self.reloaded = getattr(self, "reloaded", []) + [handle]


class PendingShim(AcceptingShim):
    """A shim whose tags are never consumed: the collective did not reach it."""

    def tag_pending(self):
        return True


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def fwd_bwd(m):
    m(torch.randn(2, 8)).sum().backward()


def expect(name, exc, words, fn):
    try:
        fn()
    except exc as e:
        msg = str(e)
        for w in words:
            if re.search(w, msg) is None:
                raise SystemExit(f"FAIL: {name}: message lacks /{w}/: {msg}")
        if dist.get_rank() == 0:
            print(f"ok: {name}: {type(e).__name__}: {msg[:140]}", flush=True)
        return
    raise SystemExit(f"FAIL: {name}: no {exc.__name__} raised")


def main():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    comp = companion.install(shim=AcceptingShim(), mode="tag")
    mesh = init_device_mesh("cpu", (world,))
    cases = 0

    if world not in (1, 4):
        raise SystemExit(f"FAIL: errors_job.py runs at 1 or 4 ranks, not {world}")
    if world == 1:
        # One rank trains (the companion issues the reduce FSDP2 elides); a divide factor
        # there would be applied differently by FSDP2's one-rank copy: refused.
        def one_rank_factor():
            m = model()
            fully_shard(m, mesh=mesh)
            m.set_gradient_divide_factor(2.0)
            fwd_bwd(m)
        expect("divide factor at world size 1", companion.CompanionError,
               ["set_gradient_divide_factor", "world size 1"], one_rank_factor)
        print("errors: 1 cases ok", flush=True)
        dist.destroy_process_group()
        return

    def not_reached():
        # gloo serves FSDP2's all-gather here (no NCCL, no shim): a shim whose tag is still
        # pending after the call says the owners took no part.
        saved = comp.shim
        comp.shim = PendingShim()
        try:
            m = model()
            fully_shard(m, mesh=mesh)
            fwd_bwd(m)
        finally:
            comp.shim = saved
    expect("collective that never reached the shim", companion.CompanionError,
           ["returned without reaching the mfsdp shim", "ncclAllGather"], not_reached)
    cases += 1

    def hsdp_shard1():
        m = model()
        hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(m, mesh=hsdp)
        fwd_bwd(m)
    expect("HSDP with one-rank shard groups", companion.CompanionError,
           ["shard group of one rank", "replication"], hsdp_shard1)
    cases += 1

    def shard1():
        m = model()
        fully_shard(m[0], mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1))
        fully_shard(m, mesh=mesh)
        fwd_bwd(m)
    expect("Shard(1) placement", ManifestError, [r"Shard\(\d\)", "Shard\\(0\\) only"], shard1)
    cases += 1

    def reshard_int():
        m = model()
        fully_shard(m[0], mesh=mesh, reshard_after_forward=world // 2)
        fully_shard(m, mesh=mesh)
        fwd_bwd(m)
    expect("reshard_after_forward=int", ManifestError, ["reshard_after_forward"], reshard_int)
    cases += 1

    def two_meshes():
        m = model()
        hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=hsdp)
        fwd_bwd(m)
    expect("two meshes in one root", ManifestError, ["one manifest needs one mesh"], two_meshes)
    cases += 1

    def bad_regex():
        os.environ["MFSDP_PY_ADAMW"] = "("
        try:
            m = model()
            fully_shard(m, mesh=mesh)
            fwd_bwd(m)
        finally:
            del os.environ["MFSDP_PY_ADAMW"]
    expect("MFSDP_PY_ADAMW", ManifestError, ["MFSDP_PY_ADAMW", "regular expression"], bad_regex)
    cases += 1

    def divide_changed():
        m = model()
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        fwd_bwd(m)  # registers with FSDP2's default rule
        m.set_force_sum_reduction_for_comms(True)  # sum + post-divide: another rule
        fwd_bwd(m)
    expect("divide rule changed after registration", companion.CompanionError,
           ["divides gradients by", "registered manifest"], divide_changed)
    cases += 1

    def clip_inf():
        m = model()
        fully_shard(m, mesh=mesh)
        fwd_bwd(m)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type=float("inf"))
    expect("clip_grad_norm_ norm_type inf", companion.CompanionError, ["2-norm only"], clip_inf)
    cases += 1

    def two_schedules():
        m = model()
        fully_shard(m, mesh=mesh)
        fwd_bwd(m)
        ps = list(m.parameters())
        opt = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-3)
        torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 0.5, lambda t: 1.0])
        opt.step()
    expect("param groups on two schedules", companion.CompanionError,
           ["different lr schedules"], two_schedules)
    cases += 1

    def bad_mode():
        saved = companion._installed
        companion._installed = None
        try:
            companion.install(shim=AcceptingShim(), mode="bogus")
        finally:
            companion._installed = saved
    expect("bad MFSDP_COMPANION", companion.CompanionError, ["expected tag or manifest"],
           bad_mode)
    cases += 1

    def fresh():
        m = model()
        fully_shard(m, mesh=mesh)
        fwd_bwd(m)
        return m

    def two_optimizers():
        m = fresh()
        # the matrices in one optimizer, the rest in another: a common Muon set-up
        opt_a = torch.optim.AdamW([p for p in m.parameters() if p.ndim == 2], lr=1e-3)
        opt_b = torch.optim.AdamW([p for p in m.parameters() if p.ndim != 2], lr=1e-3)
        opt_a.step()
        opt_b.step()
    expect("two optimizers on one root", companion.CompanionError,
           ["two optimizers step params of one FSDP2 root"], two_optimizers)
    cases += 1

    def matrix_left_out():
        m = fresh()
        opt = torch.optim.AdamW([p for n, p in m.named_parameters() if n != "2.weight"],
                                lr=1e-3)
        opt.step()
    expect("a trainable matrix in no optimizer", companion.CompanionError,
           ["in no param group", r"2\.weight"], matrix_left_out)
    cases += 1

    def grad_scaler():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        torch.amp.GradScaler("cpu").unscale_(opt)
    expect("GradScaler", companion.CompanionError, ["GradScaler", "owners' gradients"],
           grad_scaler)
    cases += 1

    def split_clip():
        m = fresh()
        torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    expect("get_total_norm over the root's gradients", companion.CompanionError,
           ["get_total_norm", "clip_grad_norm_"], split_clip)
    cases += 1

    def part_clip():
        m = fresh()
        # the first layer only: the second layer's weight, also owner-managed, left out
        torch.nn.utils.clip_grad_norm_(list(m[0].parameters()), 1.0)
    expect("clip_grad_norm_ over part of a root's matrices", companion.CompanionError,
           ["part of an FSDP2 root", "1 of its 2 owner-managed"], part_clip)
    cases += 1

    # zero_grad without a step drops the owners' gradients (a skipped step must not flow
    # into the next one); load_state_dict has the owners take the loaded weights.
    m = fresh()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    root = [r for r in comp.roots if r is not None and r.module is m][0]
    before = list(getattr(comp.shim, "zeroed", []))
    opt.zero_grad()
    m.zero_grad()
    if getattr(comp.shim, "zeroed", []) != before + [root.handle] * 2:
        raise SystemExit(f"FAIL: zero_grad did not drop the owners' gradients: "
                         f"{getattr(comp.shim, 'zeroed', [])}")
    if dist.get_rank() == 0:
        print("ok: optimizer.zero_grad() and module.zero_grad() drop the owners' gradients",
              flush=True)
    cases += 1
    root.dirty = True
    m.load_state_dict(m.state_dict())
    if set(getattr(comp.shim, "reloaded", [])) != {root.handle} or root.dirty:
        raise SystemExit(f"FAIL: load_state_dict: reloads {getattr(comp.shim, 'reloaded', [])}"
                         f", dirty {root.dirty}")
    if dist.get_rank() == 0:
        print("ok: load_state_dict has the owners take the loaded weights", flush=True)
    cases += 1

    # A job that behaves: registered once, the companion stays quiet.
    m = model()
    fully_shard(m, mesh=mesh)
    fwd_bwd(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    if not any(r is not None and r.module is m for r in comp.roots):
        raise SystemExit("FAIL: the well-formed model was not registered")
    if dist.get_rank() == 0:
        print(f"errors: {cases} cases ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
