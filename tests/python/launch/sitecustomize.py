# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY. Put on PYTHONPATH by the tests of suite `python` (tests/python/), never shipped.

- Under mpirun, gives torch.distributed the environment torchrun would (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR; the runner passes MASTER_PORT).
- MFSDP_TEST_NCCL_LIB=path/libnccl_mpi_fake.so: routes FSDP2's all-gather, reduce-scatter
  and HSDP all-reduce through that NCCL-over-MPI library (nccl_adapter.py), called through
  the global symbol namespace so that an LD_PRELOADed shim interposes as it does for
  libtorch_cuda on a GPU. torch's process groups stay gloo for everything else.
- MFSDP_TEST_FAKE_SHIM=prefix: installs the mfsdp companion with a recording stand-in for
  the shim (fake_shim.py) that appends every tag to prefix.<rank> (the same file the fake
  NCCL traces its calls to, so tags and calls interleave in issue order), for the tests
  that check tagging without the real shim.
"""
import os
import sys


def _setup():
    here = os.path.dirname(os.path.abspath(__file__))
    if "OMPI_COMM_WORLD_RANK" in os.environ and "RANK" not in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    callbacks = {}
    if os.environ.get("MFSDP_TEST_NCCL_LIB"):
        def on_collectives(module):
            sys.path.insert(0, here)
            import nccl_adapter
            nccl_adapter.install(module, os.environ["MFSDP_TEST_NCCL_LIB"])
        callbacks["torch.distributed.fsdp._fully_shard._fsdp_collectives"] = on_collectives
    if os.environ.get("MFSDP_TEST_FAKE_SHIM"):
        def on_fsdp(module):
            sys.path.insert(0, here)
            import fake_shim
            fake_shim.install(os.environ["MFSDP_TEST_FAKE_SHIM"])
        callbacks["torch.distributed.fsdp"] = on_fsdp

        def on_clip(module):
            from mfsdp import companion
            companion.patch_clip(module)
        callbacks["torch.nn.utils.clip_grad"] = on_clip
    from mfsdp import _importhook
    if callbacks:
        _importhook.after_import(callbacks)
    _importhook.chain_sitecustomize(here)


_setup()
