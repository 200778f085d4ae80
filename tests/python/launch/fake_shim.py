# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY stand-in for the shim's tagged-mode API: records what the companion asks for.

Every call appends one line to prefix.<rank> (opened in append mode and flushed, so lines
interleave in issue order with the test NCCL library's FAKE_NCCL_TRACE lines in the same
file): "register K", "tag H KIND GROUP FLAGS|- NPARAMS", "untag", "step H FACTOR",
"sqnorm H", "scale H COEF", "zero H", "reload H". Registered manifests go to prefix.<rank>.manifest<K>.json and
the FSDP2 facts of each registered root (per param: padded shard numel, local sharded size,
FQN) to prefix.<rank>.fsdp<K>.json. It moves no data: with it the job's collectives pass
through unchanged, owner-managed params just lose their gradient after the reduce.
"""
import json
import os

from mfsdp import companion


class RecordingShim:
    def __init__(self, prefix):
        self.rank = int(os.environ.get("RANK", "0"))
        self.prefix = prefix
        self.path = f"{prefix}.{self.rank}"
        self.n = 0

    def _line(self, text):
        with open(self.path, "a") as f:
            f.write(text + "\n")

    def register(self, manifest_json):
        k = self.n
        self.n += 1
        with open(f"{self.path}.manifest{k}.json", "w") as f:
            f.write(manifest_json)
        self._line(f"register {k}")
        return k

    def tag(self, handle, kind, group, has_grad, nparams):
        flags = "-" if has_grad is None else "".join("1" if g else "0" for g in has_grad)
        self._line(f"tag {handle} {kind} {group} {flags} {nparams}")

    def untag(self):
        self._line("untag")

    def tag_pending(self):
        # The recording stand-in is not the NCCL interposer: it cannot see whether the
        # tagged call reached NCCL (the tests compare the tags with the fake NCCL's trace).
        return False

    def step(self, handle, lr_factor):
        self._line(f"step {handle} {lr_factor!r}")

    def grad_sqnorm(self, handle):
        self._line(f"sqnorm {handle}")
        return 0.0

    def scale_grads(self, handle, coef):
        self._line(f"scale {handle} {coef!r}")

    def zero_grads(self, handle):
        self._line(f"zero {handle}")

    def reload(self, handle):
        self._line(f"reload {handle}")


def install(prefix):
    shim = RecordingShim(prefix)
    comp = companion.install(shim=shim, mode="tag")
    orig = comp._on_root

    def on_root(root_state):
        orig(root_state)
        root = comp.roots[-1]
        facts = []
        for g, roles in root.layout:
            pg = g.mesh_info.shard_process_group
            facts.append({
                "fqn": g._module_fqn, "world": pg.size(), "rank": pg.rank(),
                "params": [{"fqn": fp._param_fqn,
                            "padded_shard_numel": fp._sharded_param_data.numel(),
                            "padded_sharded_size": list(fp.padded_sharded_param_size),
                            "sharded_size": list(fp.sharded_size),
                            "orig_size": list(fp._orig_size),
                            "requires_grad": bool(fp.sharded_param.requires_grad)}
                           for fp in g.fsdp_params]})
        with open(f"{shim.path}.fsdp{root.handle}.json", "w") as f:
            json.dump(facts, f)
    comp._on_root = on_root
    return comp
