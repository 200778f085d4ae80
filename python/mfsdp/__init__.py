# SPDX-License-Identifier: Apache-2.0
"""mfsdp: the PyTorch FSDP2 companion of the mfsdp LD_PRELOAD shim.

Start a job with `mfsdp-run torchrun ... train.py`; nothing needs importing in train.py.
`mfsdp.sync_weights(model)` writes the owners' weights into the job's shards (state_dict()
and torch.distributed.checkpoint saves do it themselves).
"""
__version__ = "0.1.0"


def sync_weights(module=None):
    from .companion import sync_weights as _sync
    _sync(module)
