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
from mfsdp import _shim, companion  # noqa: E402
from mfsdp.companion import _local  # noqa: E402
from mfsdp.manifest import ManifestError  # noqa: E402


class AcceptingShim:
    def __init__(self):
        self.n = 0

    def register(self, manifest_json):
        self.n += 1
        return self.n - 1

    def tag(self, handle, kind, *a):
        self.tags = getattr(self, "tags", []) + [kind]

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


class CountingShim(AcceptingShim):
    """Records the manifests registered and the owners' steps."""

    def __init__(self):
        super().__init__()
        self.manifests, self.steps = [], []

    def register(self, manifest_json):
        import json
        self.manifests.append(json.loads(manifest_json))
        return super().register(manifest_json)

    def step(self, handle, lr_factor):
        self.steps.append((handle, lr_factor))


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

        # One rank: FSDP2 reads the shards the owners write back after every step; a write
        # between two steps would be overwritten by the next write-back.
        def one_rank_write():
            m = model()
            fully_shard(m, mesh=mesh)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            fwd_bwd(m)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                m[2].weight.add_(1.0)
            fwd_bwd(m)
            opt.step()
        expect("p.add_ between two steps at world size 1", companion.CompanionError,
               [r"'2\.weight' was written in place", "write-back"], one_rank_write)
        print("errors: 2 cases ok", flush=True)
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
        # the matrices split over two optimizers (the owners step them all at once)
        opt_a = torch.optim.AdamW([m[0].weight, m[0].bias, m[2].bias], lr=1e-3)
        opt_b = torch.optim.AdamW([m[2].weight], lr=1e-3)
        opt_a.step()
        opt_b.step()
    expect("matrices of one root in two optimizers", companion.CompanionError,
           ["two optimizers step matrices of one FSDP2 root"], two_optimizers)
    cases += 1

    matrices = lambda m: [m[0].weight, m[2].weight]  # noqa: E731  (owner-managed)
    others = lambda m: [m[0].bias, m[2].bias]  # noqa: E731

    # The matrices in one optimizer, the rest in another (torch.optim.Muon's set-up): the
    # other optimizer's step does not step the owners and its zero_grad() (before the
    # matrices' step) keeps the owners' gradients.
    saved = comp.shim
    comp.shim = CountingShim()
    try:
        m = fresh()
        root = [r for r in comp.roots if r is not None and r.module is m][0]
        opt_m = torch.optim.AdamW(matrices(m), lr=1e-3)
        opt_o = torch.optim.AdamW(others(m), lr=5e-4)
        sched_o = torch.optim.lr_scheduler.LambdaLR(opt_o, lambda t: 0.5 ** t)
        opt_o.step()
        opt_o.zero_grad()
        sched_o.step()
        got = (list(comp.shim.steps), list(getattr(comp.shim, "zeroed", [])))
        opt_m.step()
        opt_m.zero_grad()
        if got != ([], []) or comp.shim.steps != [(root.handle, 1.0)] or \
                comp.shim.zeroed != [root.handle]:
            raise SystemExit(f"FAIL: split optimizers: before the matrices' step {got}, after "
                             f"{comp.shim.steps}, {getattr(comp.shim, 'zeroed', [])}")
    finally:
        comp.shim = saved
    if dist.get_rank() == 0:
        print("ok: an optimizer of the other params neither steps the owners nor drops their "
              "gradients", flush=True)
    cases += 1

    # torch.optim.Muon over the matrices at the first forward: its hyper-parameters are
    # registered as the owners' (the manifest's optimizer keys).
    saved = comp.shim
    comp.shim = CountingShim()
    try:
        m = model()
        fully_shard(m, mesh=mesh)
        muon = torch.optim.Muon(matrices(m), lr=0.03, momentum=0.9, weight_decay=0.05,
                                adjust_lr_fn="match_rms_adamw")
        fwd_bwd(m)
        reg = comp.shim.manifests[-1].get("optimizer")
        want = {"lr": 0.03, "momentum": 0.9, "nesterov": True, "ns_steps": 5,
                "weight_decay": 0.05, "scale": "moonlight"}
        if reg != want:
            raise SystemExit(f"FAIL: torch.optim.Muon registered {reg}, want {want}")
        muon.step()
        if len(comp.shim.steps) != 1:
            raise SystemExit(f"FAIL: torch.optim.Muon's step ran {comp.shim.steps}")
    finally:
        comp.shim = saved
    if dist.get_rank() == 0:
        print(f"ok: torch.optim.Muon's hyper-parameters registered: {reg}", flush=True)
    cases += 1

    def muon_late():
        m = fresh()
        torch.optim.Muon(matrices(m), lr=0.02, weight_decay=0.0).step()
    expect("torch.optim.Muon created after the first forward", companion.CompanionError,
           ["did not exist at the root's first forward"], muon_late)
    cases += 1

    def sharded():  # a new FSDP2 model, not registered yet (no forward)
        m = model()
        fully_shard(m, mesh=mesh)
        return m

    def muon_changed():
        m = sharded()
        muon = torch.optim.Muon(matrices(m), lr=0.02, weight_decay=0.0)
        fwd_bwd(m)
        muon.step()
        muon.zero_grad()
        for g in muon.param_groups:  # a momentum warm-up
            g["momentum"] = 0.85
        fwd_bwd(m)
        muon.step()
    expect("torch.optim.Muon's momentum changed", companion.CompanionError,
           ["momentum is 0.85", "registered 0.95", "cannot change"], muon_changed)
    cases += 1

    def muon_with(**kw):
        def run():
            m = sharded()
            groups = kw.pop("groups", None) or [{"params": matrices(m)}]
            opt = torch.optim.Muon(groups if not callable(groups) else groups(m), **kw)
            fwd_bwd(m)  # registers the root (the optimizer must be alive then)
            opt.step()
        return run
    expect("torch.optim.Muon adjust_lr_fn=spectral_unclamped", companion.CompanionError,
           ["adjust_lr_fn='spectral_unclamped'"],
           muon_with(lr=0.02, adjust_lr_fn="spectral_unclamped"))
    cases += 1
    expect("torch.optim.Muon param groups of different weight decay", companion.CompanionError,
           ["differ in weight_decay"],
           muon_with(lr=0.02, groups=lambda m: [{"params": [m[0].weight]},
                                                {"params": [m[2].weight], "weight_decay": 0}]))
    cases += 1

    def muon_env():
        os.environ["MFSDP_LR"] = "0.05"
        try:
            muon_with(lr=0.02)()
        finally:
            del os.environ["MFSDP_LR"]
    expect("MFSDP_LR beside torch.optim.Muon", companion.CompanionError,
           ["MFSDP_LR set while torch.optim.Muon"], muon_env)
    cases += 1

    class MuonWithAuxAdam(torch.optim.AdamW):  # another Muon, whose values mfsdp cannot read
        pass

    def other_muon():
        m = fresh()
        MuonWithAuxAdam(m.parameters(), lr=0.02).step()
    expect("another Muon optimizer without MFSDP_LR", companion.CompanionError,
           ["MuonWithAuxAdam steps the matrices", "set MFSDP_LR"], other_muon)
    cases += 1
    os.environ["MFSDP_LR"] = "0.02"
    try:
        m = fresh()
        MuonWithAuxAdam(m.parameters(), lr=0.02).step()  # said which values apply: accepted
    finally:
        del os.environ["MFSDP_LR"]

    def muon_bypassed():
        m = sharded()
        muon = torch.optim.Muon(matrices(m), lr=0.02)  # noqa: F841  (registered, not used)
        fwd_bwd(m)
        torch.optim.AdamW(m.parameters(), lr=1e-3).step()
    expect("another optimizer steps matrices registered from torch.optim.Muon",
           companion.CompanionError, ["AdamW steps the matrices", "torch.optim.Muon"],
           muon_bypassed)
    cases += 1

    def matrix_left_out():
        m = fresh()
        opt = torch.optim.AdamW([p for n, p in m.named_parameters() if n != "2.weight"],
                                lr=1e-3)
        opt.step()
    expect("a trainable matrix in no optimizer", companion.CompanionError,
           ["in no param group", r"2\.weight"], matrix_left_out)
    cases += 1

    def part_zero():
        m = fresh()
        m[0].zero_grad()  # one of the root's two matrices
    expect("zero_grad() over part of a root's matrices", companion.CompanionError,
           ["1 of the 2 owner-managed matrices"], part_zero)
    cases += 1

    def stray_grad():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m[0].weight.grad = torch.ones_like(m[0].weight)
        opt.step()
    expect("a .grad set on an owner-managed matrix", companion.CompanionError,
           ["0.weight has a .grad that FSDP2's reduce-scatter did not leave"], stray_grad)
    cases += 1

    def kept_zero_unused():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()  # no backward: torch would step the matrices with their zero gradients
    expect("zero_grad(set_to_none=False) and a matrix without gradient",
           companion.CompanionError, ["got no gradient this step", "set_to_none=False"],
           kept_zero_unused)
    cases += 1

    def muon_tail():
        os.environ["MFSDP_PY_ADAMW"] = r"^2\."
        try:
            m = sharded()
            muon = torch.optim.Muon(matrices(m), lr=0.02)
            fwd_bwd(m)
        finally:
            del os.environ["MFSDP_PY_ADAMW"]
        muon.step()
    expect("torch.optim.Muon holding a param left to the job", companion.CompanionError,
           [r"also holds 2\.weight"], muon_tail)
    cases += 1
    expect("torch.optim.Muon momentum 1", companion.CompanionError,
           ["momentum in \\[0, 1\\)"], muon_with(lr=0.02, momentum=1.0))
    cases += 1

    # A submodule without matrices keeps the owners' gradients; DCP's
    # get_optimizer_state_dict between backward and step (its zero-gradient, lr-0 step that
    # builds a stateless optimizer's state) neither steps the owners nor drops their
    # gradients.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    saved = comp.shim
    comp.shim = CountingShim()
    try:
        m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        fully_shard(m, mesh=mesh)
        muon = torch.optim.Muon(matrices(m), lr=0.02)
        adamw = torch.optim.AdamW(others(m) + list(m[1].parameters()), lr=1e-3)
        fwd_bwd(m)
        m[1].zero_grad()
        get_optimizer_state_dict(m, muon)
        got = (list(comp.shim.steps), list(getattr(comp.shim, "zeroed", [])))
        adamw.step()
        muon.step()
        if got != ([], []) or len(comp.shim.steps) != 1:
            raise SystemExit(f"FAIL: submodule zero_grad / DCP state dict: owners' steps and "
                             f"drops {got} before the step, steps {comp.shim.steps} after")
    finally:
        comp.shim = saved
    if dist.get_rank() == 0:
        print("ok: a submodule's zero_grad() and DCP's get_optimizer_state_dict keep the "
              "owners' gradients and step nothing", flush=True)
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

    # An in-place write into an owner-managed matrix after the owners took its weights is
    # refused where it would be lost: at the group's next all-gather (which gathers the
    # owners' weights) and at the write-back (which overwrites the shard). A write followed by
    # load_state_dict (the owners take the shards again), model.to() and model.float() are not.
    def stepped():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        opt.step()
        opt.zero_grad()
        return m

    def write_then_forward():
        m = stepped()
        with torch.no_grad():
            m[2].weight.copy_(torch.zeros_like(m[2].weight))
        fwd_bwd(m)
    expect("p.copy_ into a matrix, then a forward", companion.CompanionError,
           [r"'2\.weight' was written in place", "all-gather", "load_state_dict"],
           write_then_forward)
    cases += 1

    def init_then_forward():
        m = fresh()  # between backward and step
        nn.init.normal_(m[0].weight)
        fwd_bwd(m)
    expect("torch.nn.init on a matrix, then a forward", companion.CompanionError,
           [r"'0\.weight' was written in place"], init_then_forward)
    cases += 1

    def write_then_state_dict():
        m = stepped()
        with torch.no_grad():
            m[0].weight.mul_(0.5)
        m.state_dict()
    expect("p.mul_ on a matrix, then state_dict()", companion.CompanionError,
           [r"'0\.weight' was written in place", "write-back", "overwrite"],
           write_then_state_dict)
    cases += 1

    m = stepped()
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m[0].weight.copy_(torch.zeros_like(m[0].weight))
    m.load_state_dict(sd)
    fwd_bwd(m)
    m.to("cpu")
    m.float()
    fwd_bwd(m)
    if dist.get_rank() == 0:
        print("ok: a write followed by load_state_dict, model.to() and model.float() train on",
              flush=True)
    cases += 1

    # The owners consume their gradients at the step; torch keeps .grad until zero_grad():
    # a second step, or a backward that would add to the kept gradients, without zero_grad()
    # in between is refused.
    def step_twice():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        opt.step()
        opt.step()
    expect("optimizer.step() twice without zero_grad()", companion.CompanionError,
           ["again with no zero_grad", "call zero_grad"], step_twice)
    cases += 1

    def backward_after_step():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        opt.step()
        fwd_bwd(m)
    expect("a backward after step() without zero_grad()", companion.CompanionError,
           ["backward after optimizer.step", "no zero_grad"], backward_after_step)
    cases += 1

    def load_before_step():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m.load_state_dict(m.state_dict())
        opt.step()
    expect("load_state_dict between backward and step", companion.CompanionError,
           ["weights loaded", "between the backward and optimizer.step"], load_before_step)
    cases += 1

    # The owners keep the matrices' optimizer state (Muon momentum): a loaded state that holds
    # other non-zero state for a matrix, or a momentum_buffer that is not the matrix's shard,
    # is refused; a rollback and a new optimizer hand their state (or zeros) to the owners at
    # the next step.
    def opt_foreign_state():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sd = opt.state_dict()
        sd["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(1)}}
        opt.load_state_dict(sd)
    expect("an optimizer state with a matrix's AdamW state", companion.CompanionError,
           [r"'exp_avg'", "owner-managed matrix 0.weight", "drop the matrices"],
           opt_foreign_state)
    cases += 1

    def opt_full_momentum():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sd = opt.state_dict()
        sd["state"] = {0: {"step": torch.tensor(1.0),
                           "momentum_buffer": torch.zeros(m[0].weight.shape)}}
        opt.load_state_dict(sd)
        opt.step()
    expect("a full momentum_buffer for a sharded matrix", companion.CompanionError,
           ["momentum_buffer loaded for owner-managed matrix 0.weight", r"Tensor \(8, 8\)",
            "not a full or differently sharded one"], opt_full_momentum)
    cases += 1

    def pushes(what, make):
        m, opt = make()
        before = list(getattr(comp.shim, "tags", []))
        opt.step()
        after = getattr(comp.shim, "tags", [])[len(before):]
        if _shim.TAG_LOAD_MOMENTUM not in after:
            raise SystemExit(f"FAIL: {what}: no momentum import at the next step ({after})")
        if dist.get_rank() == 0:
            print(f"ok: {what}: the owners take its momentum at the next step", flush=True)

    def rollback():
        m = fresh()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        saved = opt.state_dict()
        opt.step()
        opt.zero_grad()
        opt.load_state_dict(saved)
        fwd_bwd(m)
        return m, opt
    pushes("optimizer.load_state_dict after an owner step (a rollback)", rollback)

    def new_optimizer():
        m = stepped()  # its optimizer is gone
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        fwd_bwd(m)
        return m, opt
    pushes("a new optimizer after the owners stepped", new_optimizer)

    # DCP's state dict of a new optimizer (its init step gives every param zero state) shows
    # the matrices' zero momentum, so that a DCP load into it requests theirs.
    m = stepped()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    osd = get_optimizer_state_dict(m, opt)
    got = {k: sorted(v) for k, v in osd["state"].items() if k in ("0.weight", "2.weight")}
    if got != {"0.weight": ["momentum_buffer", "step"], "2.weight": ["momentum_buffer", "step"]}:
        raise SystemExit(f"FAIL: a new optimizer's DCP state dict: matrices' state {got}")
    if any(bool(_local(osd["state"][k]["momentum_buffer"]).any()) for k in got):
        raise SystemExit("FAIL: a new optimizer's DCP state dict: non-zero momentum")
    if dist.get_rank() == 0:
        print("ok: a new optimizer's DCP state dict shows the matrices' zero momentum",
              flush=True)

    m = fresh()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt.load_state_dict(opt.state_dict())  # a resume: before any owner step
    opt.step()
    if dist.get_rank() == 0:
        print("ok: optimizer.load_state_dict before the first owner step is accepted",
              flush=True)

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
