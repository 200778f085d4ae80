#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Single-process reference trainer for examples/pytorch/train_fsdp2.py (suite `python`).

It builds the same model with the same init and feeds the same global batches, emulating a
world of N ranks: for every micro-batch, the gradient of each rank's slice is computed
separately (in bf16 with --bf16, as FSDP2's MixedPrecisionPolicy does: forward and backward
on bf16 copies of the params, gradients cast to the fp32 reduce dtype) and the N gradients
are averaged (FSDP2's avg reduce-scatter); micro-batches of one step add up (the job divides
each loss by --accum). clip_grad_norm_ and the LambdaLR schedule are applied as in the job.

Optimizers (--optim):
  adamw      every trainable param in the job's AdamW: what train_fsdp2.py does alone.
  muon64     mfsdp's Muon (docs/design.md, "The optimizer step") in float64 for the 2-D block matrices (the
             params mfsdp's companion hands to the owners), the job's AdamW for the rest.
  muon32     the same Muon in float32 (the precision of mfsdp's CPU Newton-Schulz).
  torch-muon torch.optim.Muon for the block matrices (its Newton-Schulz runs in bfloat16 and
             normalises by max(||X||, eps) instead of ||X|| + 1e-7), AdamW for the rest.
  frozen-muon the block matrices never change and their gradients are left out of the clip
             norm; AdamW trains the rest: what the job does under the companion with a shim
             that moves no data (tests/python/launch/fake_shim.py).
Muon's hyper-parameters are the job's --muon-lr, --muon-momentum, --muon-wd and --muon-adjust
(mfsdp's defaults unless given: lr 0.02, momentum 0.95, weight decay 0, keller scale; the job's
torch.optim.Muon takes them with --optimizer muon), the lr multiplied by the job's lr factor
each step.

Writes {name: tensor} (torch.save) of the final weights to --out.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "pytorch"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import train_fsdp2 as job  # noqa: E402

NS_ABC = (3.4445, -4.7750, 2.0315)


def muon_params(model):
    """The params mfsdp's companion gives to owners: trainable, 2-D, not embedding/head
    (the same rule as mfsdp.manifest.param_role for this model)."""
    from mfsdp.manifest import TAIL_NAME_RE
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad or p.ndim < 2 or TAIL_NAME_RE.search(name):
            continue
        if p.shape[0] in vocab:
            continue
        out.append(name)
    return out


class Muon64:
    """mfsdp's Muon (docs/design.md, "The optimizer step") in a given dtype: momentum, Nesterov,
    X / (||X||_F + 1e-7), 5 Newton-Schulz steps, keller scale max(1, rows/cols)^0.5 or
    moonlight 0.2 sqrt(max(rows, cols))."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
                 weight_decay=0.0, scale="keller", dtype=torch.float64):
        self.params = list(params)
        self.lr, self.beta, self.nesterov = lr, momentum, nesterov
        self.ns_steps, self.wd, self.dtype = ns_steps, weight_decay, dtype
        self.scale = scale
        self.m = {id(p): torch.zeros(p.shape, dtype=dtype) for p in self.params}

    @torch.no_grad()
    def step(self, lr_factor):
        lr = self.lr * lr_factor
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.to(self.dtype)
            m = self.m[id(p)]
            m.mul_(self.beta).add_(g, alpha=1 - self.beta)
            u = (1 - self.beta) * g + self.beta * m if self.nesterov else m.clone()
            u2 = u.reshape(u.shape[0], -1)
            rows, cols = u2.shape
            x = u2.T if rows > cols else u2
            x = x / (torch.linalg.norm(x) + 1e-7)
            a, b, c = NS_ABC
            for _ in range(self.ns_steps):
                A = x @ x.T
                B = b * A + c * (A @ A)
                x = a * x + B @ x
            if rows > cols:
                x = x.T
            if self.scale == "keller":
                upd = x * max(1.0, rows / cols) ** 0.5
            else:
                upd = x * 0.2 * max(rows, cols) ** 0.5
            w = p.to(self.dtype) * (1 - lr * self.wd) - lr * upd.reshape(p.shape)
            p.copy_(w.to(p.dtype))


def train(args, world, optim):
    muon_lr = args.muon_lr
    model = job.build_model(args)
    params = dict(model.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    muon_names = muon_params(model) if optim != "adamw" else []
    adamw_params = [p for n, p in trainable.items() if n not in muon_names]
    opt, sched = job.make_optimizer(args, adamw_params)
    lam = job.lr_lambda(args)
    mp = [trainable[n] for n in muon_names]
    names = list(trainable)

    def rank_grads(x, y, r):
        rows = slice(r * args.batch, (r + 1) * args.batch)
        if args.bf16:
            call = {n: (p.to(torch.bfloat16) if p.dtype == torch.float32 else p)
                    for n, p in params.items()}
        else:
            call = dict(params)
        logits = torch.func.functional_call(model, call, (x[rows],))
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y[rows].view(-1))
        loss = loss / args.accum
        gs = torch.autograd.grad(loss, [trainable[n] for n in names], allow_unused=True)
        return loss.item(), gs

    def new_muon():
        if optim in ("muon64", "muon32"):
            return Muon64(mp, lr=muon_lr, momentum=args.muon_momentum,
                          weight_decay=args.muon_wd,
                          scale="keller" if args.muon_adjust == "original" else "moonlight",
                          dtype=torch.float64 if optim == "muon64" else torch.float32)
        if optim == "torch-muon" and mp:
            return torch.optim.Muon(mp, lr=muon_lr, weight_decay=args.muon_wd,
                                    momentum=args.muon_momentum, nesterov=True, ns_steps=5,
                                    adjust_lr_fn=args.muon_adjust)
        return None
    muon = new_muon()
    if args.optim_revert != "none" and not args.constant_lr:
        raise SystemExit("--optim-revert is emulated with --constant-lr only")

    saved = saved_optim = None
    for step in range(args.steps):
        if args.optim_revert == "load" and step == job.REVERT_AT:  # the job's --optim-revert
            opt.load_state_dict(saved_optim[0])
            if isinstance(muon, Muon64):
                muon.m = {k: v.clone() for k, v in saved_optim[1].items()}
            elif muon is not None:
                muon.load_state_dict(saved_optim[1])
        elif args.optim_revert == "new" and step == job.REVERT_AT:
            opt, sched = job.make_optimizer(args, adamw_params)
            muon = new_muon()
        if args.revert != "none" and step == job.REVERT_AT:  # the job's --revert
            keep = job.revert_scope(args)
            with torch.no_grad():
                for n, p in params.items():
                    if keep(n):
                        p.copy_(saved[n])
        acc = {n: None for n in names}
        total = 0.0
        for micro in range(args.accum):
            x, y = job.global_batch(args, step, micro, world)
            per_rank = [rank_grads(x, y, r) for r in range(world)]
            total += sum(lv for lv, _ in per_rank) / world
            for i, n in enumerate(names):
                gs = [g[i] for _, g in per_rank if g[i] is not None]
                if not gs:
                    continue
                avg = torch.stack([g.float() for g in gs]).sum(0) / world
                acc[n] = avg if acc[n] is None else acc[n] + avg
        if optim == "frozen-muon":
            for n in muon_names:
                acc[n] = None
        for n in names:
            trainable[n].grad = acc[n]
        if args.clip > 0:
            gl = [g for g in acc.values() if g is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gl]))
            coef = torch.clamp(args.clip / (norm + 1e-6), max=1.0)
            for g in gl:
                g.mul_(coef)
        factor = 1.0 if args.constant_lr else lam(step)
        if args.manual_lr:
            for group in opt.param_groups:
                group["lr"] = args.lr * factor
        opt.step()
        if isinstance(muon, Muon64):
            muon.step(factor)
        elif muon is not None:
            for gr in muon.param_groups:
                gr["lr"] = muon_lr * factor
            muon.step()
        opt.zero_grad()
        for p in mp:
            p.grad = None
        if sched is not None:
            sched.step()
        print(f"step {step} loss {total:.6f}", flush=True)
        if args.revert != "none" and step == job.REVERT_SAVE:
            saved = {n: p.detach().clone() for n, p in params.items()}
        if args.optim_revert == "load" and step == job.REVERT_SAVE:
            saved_optim = [job.clone_state(opt.state_dict()),
                           {k: v.clone() for k, v in muon.m.items()}
                           if isinstance(muon, Muon64) else
                           job.clone_state(muon.state_dict()) if muon is not None else None]
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--optim", choices=["adamw", "muon64", "muon32", "torch-muon",
                                        "frozen-muon"],
                    default="adamw")
    ap.add_argument("--out", required=True)
    ours, rest = ap.parse_known_args()
    args = job.parse_args(rest)
    torch.save(train(args, ours.world, ours.optim), ours.out)


if __name__ == "__main__":
    main()
