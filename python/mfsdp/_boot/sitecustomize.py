# SPDX-License-Identifier: Apache-2.0
"""Put first on PYTHONPATH by mfsdp-run (and python -m mfsdp.manifest): loads the
companion into every Python process of the job once it imports torch.distributed.fsdp, then
runs the sitecustomize this one shadows."""
import os
import sys


def _boot():
    here = os.path.dirname(os.path.abspath(__file__))
    pkg_parent = os.path.dirname(os.path.dirname(here))
    if pkg_parent not in sys.path:
        sys.path.append(pkg_parent)
    from mfsdp import _importhook
    if os.environ.get("MFSDP_COMPANION"):
        def on_clip(module):
            from mfsdp import companion
            companion.patch_clip(module)

        def on_utils(module):
            from mfsdp import companion
            companion.patch_split_clip(module)

        def on_fsdp(module):
            from mfsdp import companion
            companion.install()

        def on_dcp_loader(module):
            from mfsdp import companion
            companion.patch_dcp_load(module)

        def on_dcp_saver(module):
            from mfsdp import companion
            companion.patch_dcp_save(module)

        def on_dcp_state_dict(module):
            from mfsdp import companion
            companion.patch_dcp_state_dict(module)
        _importhook.after_import({"torch.nn.utils.clip_grad": on_clip,
                                  "torch.nn.utils": on_utils,
                                  "torch.distributed.fsdp": on_fsdp,
                                  "torch.distributed.checkpoint.state_dict_loader":
                                      on_dcp_loader,
                                  "torch.distributed.checkpoint.state_dict_saver":
                                      on_dcp_saver,
                                  "torch.distributed.checkpoint.state_dict":
                                      on_dcp_state_dict})
    _importhook.chain_sitecustomize(here)


_boot()
