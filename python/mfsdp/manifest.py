# SPDX-License-Identifier: Apache-2.0
"""The mfsdp-manifest/1 of a live FSDP2 model, built from FSDP2's own FSDPParamGroups.

Everything comes from the objects FSDP2 communicates with: group order, the FSDP param
order inside a group (post-order module walk, not named_parameters()), the unsharded shapes,
the dtype each param travels in (the mixed-precision param dtype), the reduce dtype, and the
gradient divide rule FSDP2 applies. Nothing is guessed: a layout the shim cannot reproduce
(Shard(d > 0), resharding to a smaller world after forward, a reduce-scatter order that is
not the all-gather order) is refused with a message naming the param or group.

    python -m mfsdp.manifest OUT.json -- torchrun --nproc-per-node 4 train.py ...

runs the job unchanged (no shim, plain FSDP2) and writes the manifest of its FSDP2 model
(from rank 0) to OUT.json as soon as the root's lazy init has run, i.e. at the first forward;
a second FSDP2 root writes OUT.json.1 and so on.
"""
import json
import os
import re
import sys

FORMAT = "mfsdp-manifest/1"
# docs/design.md, "Owners": names that are AdamW tensors even when 2-D.
TAIL_NAME_RE = re.compile(r"embed|lm_head|wte|wpe")
# Extra params for the job's optimizer (regular expression searched in the param's FQN).
ADAMW_ENV = "MFSDP_PY_ADAMW"


class ManifestError(RuntimeError):
    """The FSDP2 model has a layout the shim cannot reproduce exactly."""


def _dtype_name(torch, dtype, what):
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ManifestError(f"{what}: dtype {dtype} is not one mfsdp handles "
                            "(float32, bfloat16, float16)")
    return names[dtype]


def root_param_groups(root_state):
    """FSDPParamGroups of an FSDP2 root after its lazy init, in FSDP's state order."""
    groups, seen = [], set()
    for state in root_state._state_ctx.all_states:
        # torch 2.11 lists a state once per module of a multi-module fully_shard([a, b])
        if id(state) in seen:
            continue
        seen.add(id(state))
        # torch 2.15: a list per state (several groups per fully_shard call); 2.11: at most
        # one, _fsdp_param_group (None when the state holds no param)
        if hasattr(state, "_fsdp_param_groups"):
            gs = list(state._fsdp_param_groups)
        else:
            gs = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for i, g in enumerate(gs):
            groups.append((g, i, len(gs)))
    return groups


def _vocab_sizes(torch, root_module):
    return {m.num_embeddings for m in root_module.modules()
            if isinstance(m, torch.nn.Embedding)}


def param_role(torch, fsdp_param, vocab, extra_re=None):
    """'muon' for a trainable matrix of a block, 'adamw' (the job's optimizer) otherwise."""
    name = fsdp_param._param_fqn or ""
    shape = tuple(fsdp_param._orig_size)
    info = fsdp_param._module_info
    modules = [info.module] + list(getattr(info, "shared_modules", []) or [])
    if len(shape) < 2:
        return "adamw"
    if TAIL_NAME_RE.search(name) or (extra_re is not None and extra_re.search(name)):
        return "adamw"
    if any(isinstance(m, torch.nn.Embedding) for m in modules):
        return "adamw"
    # The output projection onto the vocabulary (torchtitan's "output"): AdamW, as Muon's
    # authors and torchtitan do.
    if any(isinstance(m, torch.nn.Linear) for m in modules) and shape[0] in vocab:
        return "adamw"
    return "muon"


def grad_dtype(fp):
    """The dtype FSDP2 reduces fp's gradient in. torch 2.15 says it (unsharded_grad_dtype:
    reduce_dtype, else the param's original dtype); 2.11 reduces in reduce_dtype, else in
    the dtype autograd computed the gradient in, the unsharded param's (param_dtype, else the
    original)."""
    if hasattr(type(fp), "unsharded_grad_dtype"):
        return fp.unsharded_grad_dtype
    return fp.reduce_dtype or fp.param_dtype or fp.orig_dtype


def divide_rule(collectives, group, reduce_dtype, device_type):
    """training.grad_divide for one FSDPParamGroup: "fsdp2" when the op on the wire says it
    all (avg, PreMulSum, or a sum on one rank), else the job's post-divide factor."""
    from torch.distributed.distributed_c10d import ReduceOp
    rs_group = group.mesh_info.shard_process_group
    ar_group = getattr(group.mesh_info, "replicate_process_group", None)
    pre, post, rs_op, _ = collectives._get_gradient_divide_factors(
        rs_group, ar_group, reduce_dtype, device_type, group.gradient_divide_factor,
        group.force_sum_reduction_for_comms)
    is_sum = rs_op == ReduceOp.SUM or getattr(rs_op, "op", None) == ReduceOp.SUM
    if not is_sum or post is None or post == 1:
        return "fsdp2"
    return float(post)


def build(root_state, root_module=None):
    """Returns (manifest dict, layout) for an FSDP2 root whose lazy init has run.

    layout: list of (FSDPParamGroup, [role per param]) in manifest group order."""
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    from torch.distributed.fsdp._fully_shard._fsdp_common import (DDPMeshInfo, FSDPMeshInfo,
                                                                  HSDPMeshInfo)
    if not root_state._is_root:
        raise ManifestError("build() needs the FSDP2 root state after its lazy init")
    if root_module is None:
        root_module = root_state._modules[0]
    extra = os.environ.get(ADAMW_ENV, "")
    try:
        extra_re = re.compile(extra) if extra else None
    except re.error as e:
        raise ManifestError(f"{ADAMW_ENV}={extra!r} is not a regular expression: {e}") from None
    vocab = _vocab_sizes(torch, root_module)
    groups, layout, names = [], [], set()
    world = replicate = divide = None
    for g, index, count in root_param_groups(root_state):
        fqn = g._module_fqn or ""
        gname = fqn if fqn else "<root>"
        if count > 1:
            gname += f"#{index}"
        if gname in names:
            raise ManifestError(f"two FSDP param groups are both named {gname!r}")
        names.add(gname)
        mi = g.mesh_info
        if not isinstance(mi, FSDPMeshInfo):
            raise ManifestError(f"group {gname!r}: {type(mi).__name__} without sharding "
                                "(replicate-only) is not an FSDP layout mfsdp can own")
        if g.post_forward_mesh_info is not None and g.post_forward_mesh_info != mi:
            raise ManifestError(
                f"group {gname!r}: reshard_after_forward={g.post_forward_mesh_info.shard_mesh_size}"
                " re-gathers on a smaller group in backward; mfsdp supports "
                "reshard_after_forward=True/False only")
        ws = mi.shard_process_group.size()
        rep = mi.replicate_process_group.size() if isinstance(mi, HSDPMeshInfo) else 1
        if isinstance(mi, DDPMeshInfo) and not isinstance(mi, HSDPMeshInfo):
            raise ManifestError(f"group {gname!r}: unexpected mesh {type(mi).__name__}")
        if world is None:
            world, replicate = ws, rep
        elif (world, replicate) != (ws, rep):
            raise ManifestError(
                f"group {gname!r} shards over {ws} ranks x {rep} replicas, an earlier group "
                f"over {world} x {replicate}: one manifest needs one mesh")
        # Only params that can have a gradient take part in a reduce-scatter.
        # (torch 2.15 packs them grouped by gradient dtype; 2.11 in group order.)
        order = getattr(g, "_reduce_scatter_param_indices", range(len(g.fsdp_params)))
        rs_order = [i for i in order if g.fsdp_params[i].sharded_param.requires_grad]
        if rs_order != sorted(rs_order):
            raise ManifestError(
                f"group {gname!r}: FSDP2 packs the reduce-scatter in another param order than "
                "the all-gather (params with different gradient dtypes); give the group one "
                "reduce dtype (MixedPrecisionPolicy(reduce_dtype=...))")
        params, roles, trainable_dtypes = [], [], set()
        for fp in g.fsdp_params:
            name = fp._param_fqn
            if not name:
                raise ManifestError(f"group {gname!r}: a param has no FQN (FSDP2 names them at "
                                    "the root's first forward; an explicit unshard() before "
                                    "it leaves them unnamed: run the forward first)")
            dim = fp.fsdp_placement.dim
            if dim != 0:
                raise ManifestError(f"{name}: Shard({dim}) placement; mfsdp supports Shard(0) "
                                    "only (no shard_placement_fn)")
            if getattr(fp, "_extensions_data", None) is not None:
                raise ManifestError(f"{name}: FSDP2 all-gather extensions (fsdp_pre_all_gather)"
                                    " change the wire layout; not supported")
            if fp.offload_to_cpu:
                raise ManifestError(f"{name}: CPU offload is not supported")
            wire = fp.param_dtype or fp.orig_dtype
            req = bool(fp.sharded_param.requires_grad)
            role = param_role(torch, fp, vocab, extra_re) if req else "adamw"
            p = {"name": name, "shape": [int(s) for s in fp._orig_size],
                 "dtype": _dtype_name(torch, wire, name), "optimizer": role,
                 "requires_grad": req}
            params.append(p)
            roles.append(role)
            if req:
                trainable_dtypes.add(grad_dtype(fp))
        grp = {"name": gname, "params": params}
        if trainable_dtypes:
            if len(trainable_dtypes) != 1:
                raise ManifestError(f"group {gname!r}: trainable params reduce in "
                                    f"{sorted(map(str, trainable_dtypes))}; one dtype needed")
            rdt = next(iter(trainable_dtypes))
            grp["reduce_dtype"] = _dtype_name(torch, rdt, f"group {gname!r} reduce dtype")
            rule = divide_rule(collectives, g, rdt, g.device.type)
            if divide is None:
                divide = rule
            elif divide != rule:
                raise ManifestError(
                    f"group {gname!r} divides gradients by {rule!r}, an earlier group by "
                    f"{divide!r}: one manifest has one rule (set_gradient_divide_factor / "
                    "set_force_sum_reduction_for_comms on every group alike)")
        groups.append(grp)
        layout.append((g, roles))
    if not groups:
        raise ManifestError("the FSDP2 root manages no param group")
    training = {"tail": "job", "grad_divide": divide if divide is not None else "fsdp2"}
    manifest = {"format": FORMAT, "world_size": world, "replicate": replicate,
                "training": training, "groups": groups}
    return manifest, layout


def dumps(manifest):
    return json.dumps(manifest, indent=1)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m mfsdp.manifest OUT.json -- COMMAND [ARGS...]"
    if len(argv) < 3 or argv[1] != "--" or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    out, cmd = os.path.abspath(argv[0]), argv[2:]
    from . import run
    env = run.companion_env(os.environ, mode="manifest")
    env["MFSDP_WRITE_MANIFEST"] = out
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        print(f"mfsdp.manifest: cannot run {cmd[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
