# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY Python emulation of the shim's tagged mode (include/mfsdp/shim.h), so that the
phase-2 end-to-end tests and the companion's integration (tags, owner step, lr factor,
clip, write-back) run before the C shim has its tagged mode. Enabled by
MFSDP_TEST_EMU_SHIM=1 (tests/python/launch/sitecustomize.py); it sits between the companion
(as its shim object) and the NCCL adapter (which hands it every collective).

It is an emulation of the semantics, not of the data movement: every rank keeps the fp32
master weights, momentum and accumulated gradient of every owner-managed param (a param's
"owner" only decides which rank counts it in grad_sqnorm), the full reduced gradient comes
from an all-reduce of the reduce-scatter input, and Muon runs in float64 (DESIGN.md
section 5). The wire still carries FSDP2's real collectives, so the job's tail (AdamW)
trains as it would under the shim. HSDP's replicate tag is not emulated (refused).
"""
import json
import math
import threading

import torch

WIRE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NS_ABC = (3.4445, -4.7750, 2.0315)


class EmuError(RuntimeError):
    pass


class _Param:
    def __init__(self, gi, pi, desc, owner):
        self.gi, self.pi, self.desc, self.owner = gi, pi, desc, owner
        self.shape = desc["shape"]
        self.n0 = self.shape[0]
        self.rest = math.prod(self.shape[1:])
        self.dtype = WIRE[desc["dtype"]]
        self.owned = desc["optimizer"] == "muon" and desc.get("requires_grad", True)
        self.master = None
        self.mom = None
        self.grad = None


class _Manifest:
    def __init__(self, m, rank):
        self.m = m
        self.ws = m["world_size"]
        self.rank = rank
        self.groups = []
        k = 0
        for gi, g in enumerate(m["groups"]):
            ps = []
            for pi, p in enumerate(g["params"]):
                ps.append(_Param(gi, pi, p, k % self.ws))
                k += 1
            self.groups.append(ps)
        self.comm = None  # ranks of the communicator of the first tagged call

    def c(self, p):
        return -(-p.n0 // self.ws)


class EmuShim:
    def __init__(self, rank):
        self.rank = rank
        self.manifests = []
        self.tls = threading.local()
        self.tagged_comms = set()

    # ---- the C API, as the companion calls it -------------------------------------------

    def register(self, manifest_json):
        self.manifests.append(_Manifest(json.loads(manifest_json), self.rank))
        return len(self.manifests) - 1

    def tag(self, handle, kind, group, has_grad, nparams):
        man = self.manifests[handle]
        if nparams != len(man.groups[group]):
            raise EmuError(f"tag: group {group} has {len(man.groups[group])} params, not {nparams}")
        if getattr(self.tls, "tag", None) is not None:
            raise EmuError("tag: the previous tag was never used")
        self.tls.tag = (handle, kind, group, None if has_grad is None else list(has_grad))

    def untag(self):
        self.tls.tag = None

    def step(self, handle, lr_factor):
        man = self.manifests[handle]
        lr = 0.02 * lr_factor
        for ps in man.groups:
            for p in ps:
                if p.owned and p.grad is not None:
                    _muon(p, lr)
                    p.grad = None

    def grad_sqnorm(self, handle):
        man = self.manifests[handle]
        return float(sum(float(p.grad.double().square().sum()) for ps in man.groups for p in ps
                         if p.owned and p.grad is not None and p.owner == self.rank))

    def scale_grads(self, handle, coef):
        for ps in self.manifests[handle].groups:
            for p in ps:
                if p.owned and p.grad is not None:
                    p.grad.mul_(coef)

    # ---- the collectives, as the NCCL adapter hands them over ---------------------------

    def _take(self, kind_name, ranks):
        t = getattr(self.tls, "tag", None)
        self.tls.tag = None
        if t is None:
            if ranks in self.tagged_comms:
                raise EmuError(f"mfsdp (emulated shim): untagged {kind_name} on a tagged "
                               "communicator")
            return None
        man = self.manifests[t[0]]
        if man.comm is None:
            man.comm = ranks
        self.tagged_comms.add(ranks)
        return t

    def allgather(self, output, input, ranks, rank_in_comm, real):
        t = self._take("all-gather", ranks)
        if t is None:
            return real()
        handle, kind, gi, _ = t
        man = self.manifests[handle]
        ps = man.groups[gi]
        if kind == 3:  # SYNC: owners' fp32 master weights, zeros elsewhere
            real()
            output.zero_()
            total = sum(man.c(p) * p.rest for p in ps)
            if output.dtype != torch.float32 or output.numel() != total * man.ws:
                raise EmuError(f"sync of group {gi}: got {output.numel()} {output.dtype}")
            off = 0
            for p in ps:
                s = man.c(p) * p.rest
                if p.owned and p.master is not None:
                    _scatter(p, man, p.master, output.view(man.ws, total), off, torch.float32)
                off += s
            return None
        if kind != 0:
            raise EmuError(f"an all-gather tagged with kind {kind}")
        real()  # FSDP2's own bytes: the tail, and the first copy of the owned weights
        mixed = len({p.dtype for p in ps}) > 1
        elts = [torch.tensor([], dtype=p.dtype).element_size() for p in ps]
        sizes = [man.c(p) * p.rest * (e if mixed else 1) for p, e in zip(ps, elts)]
        total = sum(sizes)
        if output.numel() != total * man.ws:
            raise EmuError(f"all-gather of group {gi}: count {output.numel() // man.ws}, "
                           f"layout {total}")
        rows = output.view(man.ws, total)
        off = 0
        for p, size in zip(ps, sizes):
            if p.owned:
                piece = rows[:, off:off + size]
                if mixed:
                    piece = piece.contiguous().view(p.dtype)
                if p.master is None:  # the first gather: the job's initial weights
                    full = piece.contiguous().reshape(-1)[:p.n0 * p.rest]
                    p.master = full.reshape(p.shape).to(torch.float64)
                    p.mom = torch.zeros_like(p.master)
                else:
                    padded = torch.zeros(man.c(p) * man.ws * p.rest, dtype=p.dtype)
                    padded[:p.n0 * p.rest] = p.master.reshape(-1).to(p.dtype)
                    src = padded.view(man.ws, -1)
                    if mixed:
                        src = src.view(torch.uint8)
                    rows[:, off:off + size] = src
            off += size
        return None

    def reduce_scatter(self, output, input, op, ranks, rank_in_comm, real, allreduce):
        t = self._take("reduce-scatter", ranks)
        if t is None:
            return real()
        handle, kind, gi, flags = t
        if kind != 1:
            raise EmuError(f"a reduce-scatter tagged with kind {kind}")
        man = self.manifests[handle]
        ps = man.groups[gi]
        full = input.clone()
        real()  # the job's tail is reduced by FSDP2's own call
        allreduce(full, op)  # the owners' full reduced gradients
        sel = [p for p, f in zip(ps, flags) if f]
        total = sum(man.c(p) * p.rest for p in sel)
        if input.numel() != total * man.ws:
            raise EmuError(f"reduce-scatter of group {gi}: count {output.numel()}, layout {total}")
        rows = full.view(man.ws, total)
        off = 0
        for p in sel:
            s = man.c(p) * p.rest
            if p.owned:
                g = rows[:, off:off + s].reshape(-1)[:p.n0 * p.rest].reshape(p.shape).double()
                p.grad = g if p.grad is None else p.grad + g
            off += s
        return None

    def allreduce(self, tensor, ranks, real):
        t = getattr(self.tls, "tag", None)
        if t is not None:
            self.tls.tag = None
            raise EmuError("HSDP's replicate all-reduce is not emulated")
        return real()


def _scatter(p, man, full, rows, off, dtype):
    padded = torch.zeros(man.c(p) * man.ws * p.rest, dtype=dtype)
    padded[:p.n0 * p.rest] = full.reshape(-1).to(dtype)
    rows[:, off:off + man.c(p) * p.rest] = padded.view(man.ws, -1)


def _muon(p, lr, beta=0.95):
    g = p.grad
    p.mom.mul_(beta).add_(g, alpha=1 - beta)
    u = (1 - beta) * g + beta * p.mom
    u2 = u.reshape(u.shape[0], -1)
    rows, cols = u2.shape
    x = u2.T if rows > cols else u2
    x = x / (torch.linalg.norm(x) + 1e-7)
    a, b, c = NS_ABC
    for _ in range(5):
        A = x @ x.T
        x = a * x + (b * A + c * (A @ A)) @ x
    if rows > cols:
        x = x.T
    p.master = p.master - lr * (x * max(1.0, rows / cols) ** 0.5).reshape(p.shape)


EMU = None


def get(rank):
    global EMU
    if EMU is None:
        EMU = EmuShim(rank)
    return EMU
