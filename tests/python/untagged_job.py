#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY job for `check.py untagged` (phase 2, under mfsdp-run and the NCCL adapter):
one FSDP2 training step (the shim binds the manifest to the world communicator), then an
all-gather on that communicator without a tag. The shim must refuse it; the job prints
"UNTAGGED CALL RETURNED" if it does not."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "pytorch"))
import train_fsdp2 as job  # noqa: E402


def main():
    args = job.parse_args(["--steps", "1"])
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = job.shard(args, job.build_model(args), mesh)
    opt, _ = job.make_optimizer(args, list(model.parameters()))
    x, y = job.global_batch(args, 0, 0, dist.get_world_size())
    rows = slice(dist.get_rank() * args.batch, (dist.get_rank() + 1) * args.batch)
    F.cross_entropy(model(x[rows]).view(-1, args.vocab), y[rows].view(-1)).backward()
    opt.step()
    import nccl_adapter  # the test adapter, loaded by tests/python/launch/sitecustomize.py
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(4 * n)
    inp = out.narrow(0, 4 * r, 4)
    try:
        nccl_adapter.ADAPTER.all_gather_single(out, inp, group=None)
    except RuntimeError as e:
        print(f"rank {r}: untagged all-gather refused: {e}", flush=True)
        sys.exit(3)
    print("UNTAGGED CALL RETURNED", flush=True)


if __name__ == "__main__":
    main()
