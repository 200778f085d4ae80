#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""An ordinary PyTorch FSDP2 (fully_shard) training script. It contains no mfsdp code:
`mfsdp-run torchrun --nproc-per-node N train_fsdp2.py ...` runs it with owner-local Muon.

A small pre-norm transformer on synthetic tokens (target = next token id (x + 1) mod vocab),
AdamW with a linear-warmup + cosine LambdaLR (or, with --optimizer muon, torch.optim.Muon
for the blocks' matrices beside AdamW for the rest, each with that LambdaLR), and flags for
the configurations FSDP2 jobs use: gradient accumulation (set_requires_gradient_sync),
no-grad eval, clip_grad_norm_, a frozen bf16 param, an unused trainable param, bf16 params
with fp32 reduce, activation checkpointing, torchtitan-style wrapping, tied embedding/lm_head,
HSDP, and a state_dict or DCP save of the final weights.
Init and data are deterministic (seeded), the same for every world size: rank r of n takes
rows [r*B, (r+1)*B) of each global batch of n*B sequences.

CPU: gloo backend; GPU (--device cuda): nccl. Environment as set by torchrun (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per micro-batch")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--warmup", type=int, default=2, help="warmup steps of the LambdaLR")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--constant-lr", action="store_true", help="no LambdaLR")
    p.add_argument("--manual-lr", action="store_true",
                   help="the same schedule, set in group['lr'] by the loop (no LRScheduler)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--eval-every", type=int, default=0, help="no-grad eval every k steps")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ max_norm (0: off)")
    p.add_argument("--frozen", action="store_true",
                   help="blocks.0.mlp.fc1.bias is a frozen bfloat16 param")
    p.add_argument("--frozen-matrix", action="store_true",
                   help="blocks.0.attn.wk.weight is frozen (a matrix mfsdp's owners hold "
                   "without optimizer state)")
    p.add_argument("--unused", action="store_true",
                   help="the last block has a trainable param the forward never uses")
    p.add_argument("--bf16", action="store_true",
                   help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    p.add_argument("--wrap", choices=["default", "titan"], default="default",
                   help="default: each block, then the root (embedding, norm, lm_head); "
                        "titan: embedding, each block, [norm, lm_head] as groups, root empty")
    p.add_argument("--tied", action="store_true", help="lm_head.weight is embed.weight")
    p.add_argument("--hsdp", type=int, default=1, help="replicas (HSDP) when > 1")
    p.add_argument("--reshard-root", action="store_true",
                   help="reshard_after_forward=True on the root too")
    p.add_argument("--save", default="", help="torch.save the full state_dict (rank 0)")
    p.add_argument("--dcp", default="", help="torch.distributed.checkpoint.save directory")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--idle-block", action="store_true",
                   help="the last block is never run (a module the job uses in another phase)")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing of each block (torch.utils.checkpoint)")
    p.add_argument("--revert", choices=["none", "load", "partial", "dcp", "dcp-partial",
                                        "titan", "sub", "bcast"],
                   default="none",
                   help="at the start of step 2, put back the weights saved after step 0: "
                   "model.load_state_dict of all of them (load) or of blocks.0 only with "
                   "strict=False (partial), or torch.distributed.checkpoint.load in place into "
                   "model.state_dict() (dcp: all, dcp-partial: blocks.0 only) with no "
                   "load_state_dict after it; titan: DCP save and load of a torchtitan-style "
                   "Stateful whose state dict was taken once before training; sub: "
                   "blocks.0.attn's own state_dict() and load_state_dict(); bcast: a full "
                   "state dict on rank 0 put back by set_model_state_dict(broadcast_from_rank0)"
                   "; the optimizers keep their state")
    p.add_argument("--optim-revert", choices=["none", "load", "new"], default="none",
                   help="load: every optimizer's state_dict() saved after step 0 is loaded "
                   "back before step 2 (a rollback); new: new optimizers replace them before "
                   "step 2 (fresh state)")
    p.add_argument("--stop-after", type=int, default=0,
                   help="after this many steps save a checkpoint to resume from (model, every "
                   "optimizer, the step) to --ckpt-dir and stop")
    p.add_argument("--ckpt-dir", default="", help="where --stop-after saves")
    p.add_argument("--resume-from", default="", help="resume from a --stop-after checkpoint")
    p.add_argument("--resume-via", choices=["dcp", "torch"], default="dcp",
                   help="dcp: torch.distributed.checkpoint with get/set_model_state_dict and "
                   "get/set_optimizer_state_dict; torch: torch.save of each rank's "
                   "model.state_dict() and optimizer.state_dict()")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: torch.optim.Muon for the blocks' 2-D weights, AdamW for the rest")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--muon-momentum", type=float, default=0.95)
    p.add_argument("--muon-wd", type=float, default=0.0)
    p.add_argument("--muon-adjust", choices=["original", "match_rms_adamw"],
                   default="original", help="torch.optim.Muon's adjust_lr_fn")
    return p.parse_args(argv)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads

        def split(y):
            return y.view(b, t, h, d // h).transpose(1, 2)
        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        # The bias may be a frozen param of another dtype (--frozen).
        h = F.linear(x, self.fc1.weight, self.fc1.bias.to(x.dtype))
        return self.fc2(F.gelu(h))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab, bias=False)
        if args.tied:
            self.lm_head.weight = self.embed.weight
        self.checkpoint = getattr(args, "checkpoint", False)
        self.idle = 1 if getattr(args, "idle_block", False) else 0

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks[:len(self.blocks) - self.idle]:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.lm_head(self.norm(x))


def build_model(args):
    """The model with its deterministic init (identical on every rank and world size)."""
    torch.manual_seed(args.seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight")) or name == "norm.weight":
                p.uniform_(0.8, 1.2)  # not all ones, so a layout error would show
            elif p.ndim == 1:
                p.uniform_(-0.05, 0.05)
    if args.unused:
        last = model.blocks[-1]
        last.unused = nn.Parameter(torch.randn(3, args.dim) * 0.02)
    if args.frozen:
        fc1 = model.blocks[0].mlp.fc1
        fc1.bias = nn.Parameter(fc1.bias.detach().to(torch.bfloat16), requires_grad=False)
    if args.frozen_matrix:
        model.blocks[0].attn.wk.weight.requires_grad_(False)
    return model


def global_batch(args, step, micro, world):
    """Micro-batch `micro` of optimizer step `step`: (inputs, targets) of world*batch rows."""
    g = torch.Generator().manual_seed(args.seed * 1000003 + step * 101 + micro)
    x = torch.randint(0, args.vocab, (world * args.batch, args.seq), generator=g)
    return x, (x + 1) % args.vocab


def eval_batch(args, world):
    g = torch.Generator().manual_seed(args.seed * 7919 + 17)
    x = torch.randint(0, args.vocab, (world * args.batch, args.seq), generator=g)
    return x, (x + 1) % args.vocab


def lr_lambda(args):
    """Linear warmup then cosine decay to min_lr_ratio (torchtitan's warmup-cosine)."""
    w, d, m = args.warmup, max(args.steps - args.warmup, 0), args.min_lr_ratio

    def f(t):
        t = min(t, w + d)
        if t < w:
            return (t + 1) / (w + 1)
        if d == 0:
            return 1.0
        p = (t + 1 - w) / (d + 1)
        return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def make_optimizer(args, params):
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=args.eps,
                            weight_decay=args.weight_decay)
    sched = None
    if not args.constant_lr and not args.manual_lr:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    return opt, sched


def muon_names(model):
    """The params --optimizer muon gives torch.optim.Muon: the blocks' trainable 2-D weights."""
    return [n for n, p in model.named_parameters()
            if n.startswith("blocks.") and p.ndim == 2 and p.requires_grad]


def make_optimizers(args, model):
    """[(optimizer, LambdaLR or None)]: AdamW over every trainable param, or with --optimizer
    muon torch.optim.Muon over muon_names() and AdamW over the rest."""
    names = set(muon_names(model)) if args.optimizer == "muon" else set()
    rest = [p for n, p in model.named_parameters() if p.requires_grad and n not in names]
    out = [make_optimizer(args, rest)]
    if names:
        muon = torch.optim.Muon([p for n, p in model.named_parameters() if n in names],
                                lr=args.muon_lr, momentum=args.muon_momentum, nesterov=True,
                                weight_decay=args.muon_wd, adjust_lr_fn=args.muon_adjust)
        sched = None
        if not args.constant_lr and not args.manual_lr:
            sched = torch.optim.lr_scheduler.LambdaLR(muon, lr_lambda(args))
        out.append((muon, sched))
    return out


REVERT_SAVE, REVERT_AT = 0, 2  # --revert: saved after step 0, put back before step 2


def revert_scope(args):
    """The names --revert puts back: all, blocks.0's or blocks.0.attn's."""
    if args.revert in ("partial", "dcp-partial"):
        return lambda name: name.startswith("blocks.0.")
    if args.revert == "sub":
        return lambda name: name.startswith("blocks.0.attn.")
    return lambda name: True


class CachedModelState:
    """torchtitan's ModelWrapper: a DCP Stateful whose state_dict() is the model state dict
    taken once, at its creation (its tensors are the FSDP2 shards themselves), and whose
    load_state_dict() is set_model_state_dict(strict=False)."""

    def __init__(self, model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        self.model = model
        self.cache = get_model_state_dict(model)

    def state_dict(self):
        return self.cache

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict)
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=False))


def save_for_revert(args, model, rank, cached=None):
    if args.revert in ("load", "partial"):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.revert == "sub":
        return {k: v.detach().clone() for k, v in model.blocks[0].attn.state_dict().items()}
    if args.revert == "bcast":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        # cloned: at world size 1 on the CPU these are the params' own storage
        return {k: v.clone() for k, v in full.items()}
    import tempfile
    import torch.distributed.checkpoint as dcp
    where = [tempfile.mkdtemp(prefix="mfsdp-revert-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    dcp.save({"model": cached} if cached is not None else model.state_dict(),
             checkpoint_id=where[0])
    return where[0]


def revert(args, model, saved, cached=None):
    keep = revert_scope(args)
    if args.revert == "load":
        model.load_state_dict(saved)
    elif args.revert == "partial":
        model.load_state_dict({k: v for k, v in saved.items() if keep(k)}, strict=False)
    elif args.revert == "sub":
        model.blocks[0].attn.load_state_dict(saved)
    elif args.revert == "bcast":  # rank 0 holds the values, the others an empty dict
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict)
        set_model_state_dict(model, saved, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
    elif args.revert == "titan":  # DCP loads into the cache, then calls its load_state_dict
        import torch.distributed.checkpoint as dcp
        dcp.load({"model": cached}, checkpoint_id=saved)
    else:  # in place, as plain FSDP2 allows: the state dict's tensors are the shards
        import torch.distributed.checkpoint as dcp
        state = {k: v for k, v in model.state_dict().items() if keep(k)}
        dcp.load(state, checkpoint_id=saved)


def clone_state(sd):
    """A copy of an optimizer state_dict() that later steps leave alone."""
    import copy
    return {"state": {k: {n: (v.detach().clone() if torch.is_tensor(v) else v)
                          for n, v in entry.items()}
                      for k, entry in sd["state"].items()},
            "param_groups": copy.deepcopy(sd["param_groups"])}


def save_resumable(args, model, optimizers, step, rank):
    """--stop-after: the sharded state of the model and of every optimizer after `step` steps
    (the LambdaLRs follow from the step and the optimizers' param groups)."""
    if args.resume_via == "torch":
        os.makedirs(args.ckpt_dir, exist_ok=True)
        torch.save({"step": step, "model": model.state_dict(),
                    "optim": [opt.state_dict() for opt, _ in optimizers]},
                   os.path.join(args.ckpt_dir, f"rank{rank}.pt"))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    state = {"step": torch.tensor(step), "model": get_model_state_dict(model)}
    for i, (opt, _) in enumerate(optimizers):
        state[f"optim{i}"] = get_optimizer_state_dict(model, opt)
    dcp.save(state, checkpoint_id=args.ckpt_dir)


def load_resumable(args, model, optimizers, rank):
    """--resume-from: load what save_resumable saved; returns the step to go on from."""
    if args.resume_via == "torch":
        state = torch.load(os.path.join(args.resume_from, f"rank{rank}.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        for (opt, _), sd in zip(optimizers, state["optim"]):
            opt.load_state_dict(sd)
        start = int(state["step"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)
        state = {"step": torch.tensor(0), "model": get_model_state_dict(model)}
        for i, (opt, _) in enumerate(optimizers):
            state[f"optim{i}"] = get_optimizer_state_dict(model, opt)
        dcp.load(state, checkpoint_id=args.resume_from)
        set_model_state_dict(model, state["model"])
        for i, (opt, _) in enumerate(optimizers):
            set_optimizer_state_dict(model, opt, state[f"optim{i}"])
        start = int(state["step"])
    for opt, sched in optimizers:
        if sched is not None:  # the loaded param groups hold the lr of step `start` already
            sched.last_epoch = start
            sched._last_lr = [group["lr"] for group in opt.param_groups]
    return start


def shard(args, model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"mesh": mesh}
    if args.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if args.wrap == "titan":
        fully_shard(model.embed, **kw)
    for b in model.blocks:
        fully_shard(b, **kw)
    if args.wrap == "titan":
        fully_shard([model.norm, model.lm_head], **kw)
    fully_shard(model, reshard_after_forward=args.reshard_root, **kw)
    return model


def main(argv=None):
    args = parse_args(argv)
    if args.tied and args.wrap == "titan":
        raise SystemExit("--tied needs --wrap default (a tied weight lives in one group)")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        # modulo: several ranks may share one GPU (each with its own NCCL_HOSTID)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh
    if args.hsdp > 1:
        if world % args.hsdp:
            raise SystemExit(f"--hsdp {args.hsdp} does not divide world size {world}")
        mesh = init_device_mesh(device.type, (args.hsdp, world // args.hsdp),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))

    model = build_model(args).to(device)
    shard(args, model, mesh)
    optimizers = make_optimizers(args, model)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)

    def loss_of(x, y):
        logits = model(x[rows].to(device))
        return F.cross_entropy(logits.float().view(-1, args.vocab), y[rows].to(device).view(-1))

    if (args.revert != "none" or args.optim_revert != "none") and args.steps <= REVERT_AT:
        raise SystemExit(f"--revert and --optim-revert need --steps > {REVERT_AT}")
    saved = None
    cached = CachedModelState(model) if args.revert == "titan" else None
    start = load_resumable(args, model, optimizers, rank) if args.resume_from else 0
    for step in range(start, args.steps):
        if args.revert != "none" and step == REVERT_AT:
            revert(args, model, saved, cached)
        if args.optim_revert == "load" and step == REVERT_AT:
            for (opt, _), sd in zip(optimizers, saved_optim):
                opt.load_state_dict(sd)
        elif args.optim_revert == "new" and step == REVERT_AT:
            import gc
            optimizers = None
            gc.collect()  # the old optimizers are gone before the new ones step
            optimizers = make_optimizers(args, model)
        total = 0.0
        for micro in range(args.accum):
            model.set_requires_gradient_sync(micro == args.accum - 1)
            x, y = global_batch(args, step, micro, world)
            loss = loss_of(x, y) / args.accum
            loss.backward()
            total += loss.item()
        norm = None
        if args.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        # AdamW first: its zero_grad() runs before Muon's step
        for opt, sched in optimizers:
            if args.manual_lr:
                base = args.muon_lr if opt is not optimizers[0][0] else args.lr
                for group in opt.param_groups:
                    group["lr"] = base * lr_lambda(args)(step)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
        line = f"step {step} loss {total:.6f}"
        if norm is not None:
            line += f" norm {float(norm):.6f}"
        if args.eval_every and (step + 1) % args.eval_every == 0:
            with torch.no_grad():
                ex, ey = eval_batch(args, world)
                line += f" eval {loss_of(ex, ey).item():.6f}"
        if rank == 0:
            print(line, flush=True)
        if args.revert != "none" and step == REVERT_SAVE:
            saved = save_for_revert(args, model, rank, cached)
        if args.optim_revert == "load" and step == REVERT_SAVE:
            saved_optim = [clone_state(opt.state_dict()) for opt, _ in optimizers]
        if args.stop_after and step + 1 == args.stop_after:
            save_resumable(args, model, optimizers, step + 1, rank)
            break

    if args.dcp:
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": model.state_dict()}, checkpoint_id=args.dcp)
    if args.save:
        state = model.state_dict()
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in state.items()}
        if rank == 0:
            torch.save(full, args.save)
    dist.barrier()
    if isinstance(saved, str) and rank == 0:
        import shutil
        shutil.rmtree(saved, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
