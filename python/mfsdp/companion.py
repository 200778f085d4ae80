# SPDX-License-Identifier: Apache-2.0
"""The companion inside the job: FSDP2 hooks that drive the shim's tagged mode.

install() runs when torch.distributed.fsdp has been imported (the mfsdp-run path hook). It
- registers, at each FSDP2 root's lazy init, the manifest built from its FSDPParamGroups;
- tags, on the calling thread right before the call, every FSDP2 all-gather (group g),
  reduce-scatter (group g over exactly the params that have a gradient now) and HSDP
  replicate all-reduce, by replacing the ``dist`` that ``_fsdp_collectives`` calls with a
  proxy that tags and forwards, and stops the job when a tagged call did not reach the shim;
- on one rank, where FSDP2 issues no collective, issues the tagged collectives itself (the
  owners' first fill, each reduce) and writes the weights back after every owner step;
- sets ``.grad = None`` on owner-managed params after their reduce, so the job's optimizer
  skips them and allocates no state for them;
- runs the owners' step from the ``step()`` of the job's optimizer that holds the root's
  matrices (a global step pre-hook) with lr_factor = its current lr / its initial lr; when
  that optimizer is ``torch.optim.Muon``, its hyper-parameters (taken at the first forward)
  are the owners' Muon hyper-parameters, and they must not change afterwards;
- makes ``clip_grad_norm_`` include and scale the owners' gradients;
- writes the owners' weights back into the job's shards before ``state_dict()`` (of any module
  of the root) and before DCP's save and load of a state holding them;
- puts the owners' Muon momentum into the job optimizer's ``state_dict()`` (each matrix's
  ``momentum_buffer``, sharded as the matrix, as torch.optim.Muon keeps it), and hands a
  loaded one (``load_state_dict``, a resume, a rollback; none: zeros) to the owners at the
  next step.
"""
import inspect
import math
import os
import sys
import threading

from . import _guard, _shim
from .manifest import ManifestError, build, dumps, grad_dtype

# mfsdp's Newton-Schulz constants (docs/design.md, "The optimizer step"), torch.optim.Muon's
# defaults: a torch.optim.Muon with other values cannot be followed.
_NS_ABC = (3.4445, -4.7750, 2.0315)
_NS_EPS = 1e-7
# torch.optim.Muon's adjust_lr_fn -> the manifest's optimizer.scale
_MUON_SCALE = {None: "keller", "original": "keller", "match_rms_adamw": "moonlight"}
# The shim's variables that override the Muon hyper-parameters torch.optim.Muon gives.
_MUON_ENV = ("MFSDP_LR", "MFSDP_MOMENTUM", "MFSDP_NESTEROV", "MFSDP_NS_STEPS",
             "MFSDP_WEIGHT_DECAY", "MFSDP_SCALE")

# What the owners keep of a matrix's optimizer state, as the job's optimizer shows it: Muon's
# momentum and, for an optimizer other than torch.optim.Muon, the step count.
_OWNER_STATE = ("momentum_buffer", "step")

_tls = threading.local()
_lock = threading.Lock()
_installed = None


def _num(x):
    """A float from a number or a one-element tensor (an optimizer's lr, momentum, ...)."""
    return float(x.item() if hasattr(x, "item") else x)


def _local(t):
    """A DTensor's local tensor, or t."""
    return getattr(t, "_local_tensor", t)


def _log(msg):
    print(f"mfsdp: {msg}", file=sys.stderr, flush=True)


class CompanionError(RuntimeError):
    """The companion met something it cannot handle exactly."""


class _Root:
    """One registered FSDP2 root: its manifest handle and layout."""

    def __init__(self, handle, manifest, layout, module, shard_group):
        self.handle = handle
        self.manifest = manifest
        self.layout = layout  # [(FSDPParamGroup, roles)]
        self.module = module
        self.shard_group = shard_group
        self.param_of = {}  # id(FSDPParam) -> (group index, param index)
        self.owned = set()  # id(sharded param) of owner-managed params
        self.params = set()  # id(sharded param) of every managed param
        for gi, (g, roles) in enumerate(layout):
            for pi, fp in enumerate(g.fsdp_params):
                self.param_of[id(fp)] = (gi, pi)
                self.params.add(id(fp.sharded_param))
                if roles[pi] == "muon" and fp.sharded_param.requires_grad:
                    self.owned.add(id(fp.sharded_param))
        self.dirty = False  # owners stepped since the last write-back
        self.optimizer = None  # weakref to the one optimizer that steps the root's matrices
        # torch.optim.Muon over the root's matrices at the first forward: a weakref to it and
        # the hyper-parameters registered from it (the manifest's optimizer keys)
        self.muon = None
        self.muon_hp = None
        self.reduced = set()  # id(sharded param) of owned matrices reduced since the last step
        self.zero_kept = False  # the last drop of the owners' gradients was set_to_none=False
        self.keep_next_zero = False  # the zero_grad() right after a skipped DCP init step
        # the owners stepped and no zero_grad() dropped their gradients since: torch keeps the
        # matrices' .grad across the step (a second step reapplies it, a backward adds to
        # it), the owners consumed theirs at the step
        self.stepped = False
        # groups whose weights were loaded (load_state_dict, DCP) and not gathered since: the
        # owners take them at the group's next all-gather
        self.loaded = set()
        self.gathered = set()  # groups the owners took weights for (a tagged all-gather)
        # id(FSDPParam) -> version counters of an owned matrix's shard when the owners took or
        # wrote back its weights: a write since then (p.copy_, torch.nn.init) would be lost
        self.versions = {}
        # Optimizer state of the owned matrices, which the owners hold (their Muon momentum):
        # id(sharded param) of those torch's optimizer would hold state for (stepped with a
        # gradient, loaded, or given zero state by DCP's init step); the owners' momentum may
        # be non-zero; a state loaded into the job's optimizer (or a new optimizer) that the
        # owners take at the next step, before it (its momentum_buffer entries; none: zero).
        self.has_state = set()
        self.steps = {}  # id(sharded param) -> steps it had a gradient at (torch's "step")
        self.momentum_live = False
        self.load_pending = False


class Companion:
    def __init__(self, shim, mode="tag"):
        import torch
        import torch.distributed as dist
        import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
        import torch.distributed.fsdp._fully_shard._fsdp_state as state
        self.torch, self.dist = torch, dist
        self.collectives, self.param_group, self.state = collectives, param_group, state
        self.entry = _guard.check_live(torch, collectives, param_group, state)
        self.shim = shim
        self.mode = mode
        self.roots = []
        self.group_root = {}  # id(FSDPParamGroup) -> (root, group index)
        self.write_path = os.environ.get("MFSDP_WRITE_MANIFEST", "")
        self._hook_lazy_init()
        if mode == "tag":
            self._hook_collectives()
            self._hook_optimizer()
            import torch.nn.utils.clip_grad as clip_mod
            patch_clip(clip_mod)
            patch_split_clip(sys.modules["torch.nn.utils"])
            pkg = sys.modules.get("torch.distributed.checkpoint")
            for mod, patch, names in (
                    ("state_dict_loader", patch_dcp_load, ("load", "load_state_dict")),
                    ("state_dict_saver", patch_dcp_save, ("save", "save_state_dict",
                                                          "async_save")),
                    ("state_dict", patch_dcp_state_dict, ())):
                m = sys.modules.get("torch.distributed.checkpoint." + mod)
                if m is not None:  # imported before the companion: rebind the package's names
                    patch(m)
                    for name in names:
                        if pkg is not None and hasattr(pkg, name):
                            setattr(pkg, name, getattr(m, name))

    # ---- registration ----------------------------------------------------------------

    def _hook_lazy_init(self):
        comp = self
        orig = self.state.FSDPState._lazy_init
        if getattr(orig, "_mfsdp", False):
            return

        def _lazy_init(self_state):
            first = self_state._is_root is None
            orig(self_state)
            if first and self_state._is_root:
                comp._on_root(self_state)
        _lazy_init._mfsdp = True
        _lazy_init._mfsdp_orig = orig
        self.state.FSDPState._lazy_init = _lazy_init

    def _on_root(self, root_state):
        module = root_state._modules[0]
        manifest, layout = build(root_state, module)
        g0 = layout[0][0]
        pg = g0.mesh_info.shard_process_group
        rank = self.dist.get_rank() if self.dist.is_initialized() else 0
        if self.mode == "manifest":
            if rank == 0 and self.write_path:
                path = self.write_path
                if self.roots:
                    path += f".{len(self.roots)}"
                with open(path + ".tmp", "w") as f:
                    f.write(dumps(manifest) + "\n")
                os.replace(path + ".tmp", path)
                _log(f"wrote the manifest of FSDP2 root {type(module).__name__} to {path}")
            self.roots.append(None)
            return
        if manifest["world_size"] == 1 and manifest["replicate"] > 1:
            raise CompanionError(
                f"HSDP with a shard group of one rank ({manifest['replicate']} replicas of 1): "
                "every rank would own every matrix, which is plain replication; mfsdp does not "
                "support it (use a shard group of 2 or more ranks, or run without mfsdp-run)")
        root = _Root(None, manifest, layout, module, pg)
        self._adopt_muon(root)  # torch.optim.Muon's hyper-parameters into the manifest
        if self.write_path and rank == 0:
            with open(self.write_path, "w") as f:
                f.write(dumps(manifest) + "\n")
        root.handle = self.shim.register(dumps(manifest))
        with _lock:
            self.roots.append(root)
            for gi, (g, _) in enumerate(layout):
                self.group_root[id(g)] = (root, gi)
        self._hook_state_dict(root)
        if manifest["world_size"] == 1:
            self._one_rank_fill(root)
        if rank == 0:
            _log(f"registered {len(layout)} FSDP2 groups of {type(module).__name__} "
                 f"({len(root.owned)} owner-managed matrices, world {manifest['world_size']} "
                 f"x {manifest['replicate']})" +
                 (f"; Muon hyper-parameters from torch.optim.Muon: {root.muon_hp}"
                  if root.muon_hp is not None else ""))

    def _muon_class(self):
        return getattr(self.torch.optim, "Muon", None)

    def _adopt_muon(self, root):
        """A torch.optim.Muon that holds matrices of the root at its first forward: its
        hyper-parameters become the owners' (the manifest's optimizer keys, which the shim
        registers and agrees across ranks)."""
        import weakref
        cls = self._muon_class()
        if cls is None or not root.owned:
            return
        found = [o for o in list(getattr(self, "_lr0", {}).keys())
                 if isinstance(o, cls) and
                 any(id(p) in root.owned for g in o.param_groups for p in g["params"])]
        if not found:
            return
        if len(found) > 1:
            raise CompanionError(
                f"{len(found)} torch.optim.Muon optimizers hold matrices of one FSDP2 root; "
                "mfsdp's owners step every matrix of a root with one set of Muon "
                "hyper-parameters: put the root's matrices in one torch.optim.Muon")
        hp = self._muon_hparams(found[0], root)
        env = [v for v in _MUON_ENV if os.environ.get(v)]
        if env:
            raise CompanionError(
                f"{', '.join(env)} set while torch.optim.Muon steps the matrices of the FSDP2 "
                "root: mfsdp's owners take Muon's hyper-parameters from torch.optim.Muon, so "
                "these variables would contradict it; set the values on torch.optim.Muon and "
                "unset the variables")
        root.manifest.setdefault("optimizer", {}).update(hp)
        root.muon = weakref.ref(found[0])
        root.muon_hp = hp

    def _muon_hparams(self, optimizer, root):
        """The owners' Muon hyper-parameters (the manifest's optimizer keys, lr = the initial
        lr) from the param groups of torch.optim.Muon `optimizer` that hold matrices of the
        root; CompanionError where mfsdp's Muon cannot do what the optimizer says."""
        hp, first = None, None
        for i, group in enumerate(optimizer.param_groups):
            if not any(id(p) in root.owned for p in group["params"]):
                continue
            adjust = group.get("adjust_lr_fn")
            if adjust not in _MUON_SCALE:
                raise CompanionError(
                    f"torch.optim.Muon param group {i}: adjust_lr_fn={adjust!r}; mfsdp's owners "
                    "scale updates as 'original' (max(1, rows/cols)^0.5, the default) or "
                    "'match_rms_adamw' (0.2 sqrt(max(rows, cols))) only")
            coef = tuple(_num(c) for c in group.get("ns_coefficients", _NS_ABC))
            if coef != _NS_ABC:
                raise CompanionError(
                    f"torch.optim.Muon param group {i}: ns_coefficients={coef}; mfsdp's "
                    f"Newton-Schulz uses {_NS_ABC} (torch's default) only")
            eps = _num(group.get("eps", _NS_EPS))
            if eps != _NS_EPS:
                raise CompanionError(
                    f"torch.optim.Muon param group {i}: eps={eps}; mfsdp's Newton-Schulz "
                    f"normalises by the norm + {_NS_EPS} (torch's default eps) only")
            if not 0.0 <= _num(group["momentum"]) < 1.0 or not 0 <= int(group["ns_steps"]) < 100:
                raise CompanionError(
                    f"torch.optim.Muon param group {i}: momentum {group['momentum']} and "
                    f"ns_steps {group['ns_steps']}; mfsdp's Muon takes momentum in [0, 1) and "
                    "ns_steps in [0, 100) (torch's own limit)")
            one = {"lr": self._initial_lr(optimizer, i, group),
                   "momentum": _num(group["momentum"]),
                   "nesterov": bool(group["nesterov"]),
                   "ns_steps": int(group["ns_steps"]),
                   "weight_decay": _num(group["weight_decay"]),
                   "scale": _MUON_SCALE[adjust]}
            if hp is None:
                hp, first = one, i
            elif one != hp:
                key = next(k for k in hp if hp[k] != one[k])
                raise CompanionError(
                    f"torch.optim.Muon's param groups {first} and {i} differ in {key} "
                    f"({hp[key]!r} vs {one[key]!r}); mfsdp's owners step every matrix of an "
                    "FSDP2 root with one set of Muon hyper-parameters (the lr may follow a "
                    "schedule, the same for all)")
        return hp

    def _check_muon_unchanged(self, root, optimizer):
        hp = self._muon_hparams(optimizer, root)
        if hp != root.muon_hp:
            key = next(k for k in root.muon_hp if hp is None or hp.get(k) != root.muon_hp[k])
            now = hp.get(key) if hp is not None else None
            raise CompanionError(
                f"torch.optim.Muon's {'initial lr' if key == 'lr' else key} is {now!r}, but "
                f"mfsdp registered {root.muon_hp[key]!r} from it at the FSDP2 root's first "
                "forward: the owners' Muon hyper-parameters cannot change during training (a "
                "momentum or weight-decay schedule); only the lr may follow a schedule "
                "(through its current / initial ratio)")

    # ---- tagging ---------------------------------------------------------------------

    def _lookup_params(self, fsdp_params, what):
        if not fsdp_params:
            raise CompanionError(f"{what}: no params")
        for root in self.roots:
            if root is not None and id(fsdp_params[0]) in root.param_of:
                return root
        name = fsdp_params[0]._param_fqn
        raise CompanionError(
            f"{what} of FSDP2 param {name or '(not named yet)'} before its root's first forward "
            "(an explicit unshard() before it?): mfsdp registers an FSDP2 model at its root's "
            "first forward; run that forward before calling unshard()")

    def _hook_collectives(self):
        comp = self
        c, pgmod = self.collectives, self.param_group
        orig_ag, orig_rs = c.foreach_all_gather, c.foreach_reduce

        def foreach_all_gather(fsdp_params, group, *args, **kwargs):
            root = comp._lookup_params(fsdp_params, "all-gather")
            gi, _ = root.param_of[id(fsdp_params[0])]
            g = root.layout[gi][0]
            if fsdp_params is not g.fsdp_params and list(fsdp_params) != list(g.fsdp_params):
                raise CompanionError(f"all-gather of group {gi} over a subset of its params")
            comp._check_versions(root, gi, "this all-gather would have gathered the owners' "
                                 "weights over it")
            _tls.pending = ("ag", root, gi, None)
            try:
                out = orig_ag(fsdp_params, group, *args, **kwargs)
            finally:
                _tls.pending = None
            comp._record_versions(root, gi)
            root.loaded.discard(gi)
            return out

        sig = inspect.signature(orig_rs)

        def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs):
            root = comp._lookup_params(fsdp_params, "reduce-scatter")
            gi, _ = root.param_of[id(fsdp_params[0])]
            g, roles = root.layout[gi]
            flags = [0] * len(g.fsdp_params)
            last = -1
            for fp in fsdp_params:
                gj, pi = root.param_of.get(id(fp), (None, None))
                if gj != gi:
                    raise CompanionError("one reduce-scatter spans two FSDP groups")
                if pi <= last:
                    raise CompanionError(
                        f"group {gi}: reduce-scatter param order differs from the manifest")
                last = pi
                flags[pi] = 1
            comp._check_divide(root, gi, g)
            if root.stepped and any(id(fp.sharded_param) in root.owned for fp in fsdp_params):
                raise CompanionError(
                    "a backward after optimizer.step() with no zero_grad() in between: torch "
                    "would add the owner-managed matrices' new gradients to those their .grad "
                    "keeps from before the step, mfsdp's owners used theirs at the step; call "
                    "zero_grad() (of the optimizer or the model) after each step or before each "
                    "backward")
            one = None
            if reduce_scatter_group is None or reduce_scatter_group.size() == 1:
                bound = sig.bind(fsdp_params, unsharded_grads, reduce_scatter_group, *args,
                                 **kwargs)
                one = comp._one_rank_input(root, gi, fsdp_params, unsharded_grads,
                                           bound.arguments)
            _tls.pending = ("rs", root, gi, flags)
            try:
                if one is not None:
                    comp._one_rank_reduce(one, reduce_scatter_group)
                out = orig_rs(fsdp_params, unsharded_grads, reduce_scatter_group, *args,
                              **kwargs)
            finally:
                _tls.pending = None
            # Owner-managed params: the owner holds their reduced gradient; the job's
            # optimizer must skip them (and keep no state for them).
            for fp in fsdp_params:
                if id(fp.sharded_param) in root.owned:
                    fp.sharded_param.grad = None
                    root.reduced.add(id(fp.sharded_param))
            return out

        foreach_all_gather._mfsdp = foreach_reduce._mfsdp = True
        c.foreach_all_gather = pgmod.foreach_all_gather = foreach_all_gather
        c.foreach_reduce = pgmod.foreach_reduce = foreach_reduce
        c.dist = _DistProxy(c.dist, self)

    # ---- one rank -------------------------------------------------------------------
    # FSDP2 (torch >= 2.9) issues no collective on a one-rank shard group: foreach_reduce
    # copies its input to its output, unshard copies the local shard. The companion issues
    # the reduce-scatter FSDP2 elides itself (tagged, on the same process group), so that the
    # owner (rank 0, which owns everything) receives the gradient exactly as at n ranks, and
    # writes the owners' weights back into the shards after every owner step, since the next
    # unshard reads them there.

    def _one_rank_fill(self, root):
        """The owners' first weights: at n ranks they come with the first all-gather of each
        group, which FSDP2 does not issue on one rank; issue it (tagged) once per group."""
        torch = self.torch
        with torch.no_grad():
            for gi, (g, _) in enumerate(root.layout):
                ins = []
                for fp in g.fsdp_params:
                    inputs = fp.all_gather_inputs  # FSDP2's own input (param dtype)
                    if len(inputs) != 1:
                        raise CompanionError(
                            f"param {fp._param_fqn!r}: {len(inputs)} all-gather inputs (a "
                            "tensor subclass with its own all-gather); mfsdp takes one")
                    ins.append(inputs[0].detach().reshape(-1))
                if len({t.dtype for t in ins}) > 1:  # FSDP2 gathers mixed dtypes as bytes
                    ins = [t.view(torch.uint8) for t in ins]
                out = torch.cat(ins)
                # in place, as FSDP2's own all-gather (the input is rank 0's block)
                self._all_gather("ag", root, gi, out, out.narrow(0, 0, out.numel()),
                                 g.mesh_info.shard_process_group)
                self._record_versions(root, gi)

    # ---- in-place writes -------------------------------------------------------------
    # The owners hold the weights that train; the job's shards are only read by the
    # owners when they take weights (the first all-gather of a group, the one after a
    # load_state_dict) and written by the write-back. A write into an owned matrix's shard
    # between those points (p.copy_, torch.nn.init, p.mul_, an EMA swap through the params)
    # would be lost: refused, found by the version counters torch bumps on in-place writes
    # (of the DTensor param, its local tensor and FSDP2's padded shard). Writes through
    # p.data or into a state_dict()'s detached tensors bump none of them (docs/pytorch.md).

    @staticmethod
    def _versions(fp):
        p = fp.sharded_param
        local = getattr(p, "_local_tensor", None)
        return (p._version, local._version if local is not None else -1,
                fp._sharded_param_data._version)

    def _record_versions(self, root, gi):
        for fp in root.layout[gi][0].fsdp_params:
            if id(fp.sharded_param) in root.owned:
                root.versions[id(fp)] = self._versions(fp)

    def _written_since(self, root, fp):
        """True when fp's shard was written in place since the owners took or wrote back its
        weights (its version counters moved)."""
        was = root.versions.get(id(fp))
        return was is not None and was != self._versions(fp)

    def _check_versions(self, root, gi, when):
        for fp in root.layout[gi][0].fsdp_params:
            if self._written_since(root, fp):
                raise CompanionError(
                    f"owner-managed matrix {fp._param_fqn!r} was written in place (p.copy_, "
                    "torch.nn.init, an EMA swap through the params) after mfsdp's owners took "
                    f"its weights; {when}. The owners hold the weights that train and never "
                    "see such a write: load weights with model.load_state_dict() or "
                    "set_model_state_dict() (the owners take them at the next all-gather)")

    def _all_gather(self, what, root, gi, out, inp, pg):
        """An all-gather the companion issues itself, tagged as `what` ("ag": the owners'
        fill, "sync": the write-back, "sync_m" / "load_m": the momentum export / import) for
        group gi, through the tagging proxy and the release's
        entry point (2.15: all_gather_single, 2.11: all_gather_into_tensor; same (output,
        input, group) arguments)."""
        _tls.pending = (what, root, gi, None)
        try:
            getattr(self.collectives.dist, self.entry["all_gather"])(out, inp, group=pg)
        finally:
            _tls.pending = None

    def _one_rank_input(self, root, gi, fsdp_params, unsharded_grads, arguments):
        """The reduce-scatter input FSDP2 would build at world size 1 (the gradients of
        fsdp_params flattened and concatenated in the reduce dtype), or CompanionError where
        the one-rank copy FSDP2 makes instead would not be that input unchanged."""
        torch = self.torch
        name = root.manifest["groups"][gi]["name"]
        factor = arguments.get("gradient_divide_factor")
        if factor is not None and float(factor) != 1.0:
            raise CompanionError(
                f"group {name!r}: set_gradient_divide_factor({factor}) at world size 1 is not "
                "supported by mfsdp (FSDP2 divides its one-rank copy differently from its "
                "n-rank reduce-scatter)")
        if len(unsharded_grads) != len(fsdp_params):
            raise CompanionError(f"group {name!r}: {len(unsharded_grads)} gradients for "
                                 f"{len(fsdp_params)} params in one reduce")
        rdt = arguments.get("reduce_dtype")
        dtypes = {gr.dtype for gr in unsharded_grads}
        if rdt is None:
            if len(dtypes) != 1:
                raise CompanionError(
                    f"group {name!r}: gradients of several dtypes {sorted(map(str, dtypes))} "
                    "and no reduce_dtype at world size 1 (set MixedPrecisionPolicy.reduce_dtype)")
            rdt = next(iter(dtypes))
        return torch.cat([gr.detach().reshape(-1).to(rdt) for gr in unsharded_grads])

    def _one_rank_reduce(self, flat, group):
        """The tagged one-rank reduce-scatter (the caller has set the pending tag)."""
        out = self.torch.empty_like(flat)
        fn = getattr(self.collectives.dist, self.entry["reduce_scatter"])
        fn(out, flat, group=group, op=self.dist.ReduceOp.SUM)

    def _check_divide(self, root, gi, g):
        from .manifest import divide_rule
        want = root.manifest["training"]["grad_divide"]
        rdt = None
        for fp in g.fsdp_params:
            if fp.sharded_param.requires_grad:
                rdt = grad_dtype(fp)
                break
        if rdt is None:
            return
        got = divide_rule(self.collectives, g, rdt, g.device.type)
        if got != want:
            raise CompanionError(
                f"group {root.manifest['groups'][gi]['name']!r} now divides gradients by {got!r}"
                f", the registered manifest says {want!r} (set_gradient_divide_factor or "
                "set_force_sum_reduction_for_comms changed after the first forward)")

    def tag_for(self, kind):
        """Called by the proxy right before a collective; returns True when it tagged."""
        pending = getattr(_tls, "pending", None)
        if pending is None:
            return False
        what, root, gi, flags = pending
        g = root.layout[gi][0]
        n = len(g.fsdp_params)
        if kind == "all_gather" and what == "ag":
            self.shim.tag(root.handle, _shim.TAG_ALLGATHER, gi, None, n)
            root.gathered.add(gi)
        elif kind == "all_gather" and what == "sync":
            self.shim.tag(root.handle, _shim.TAG_SYNC, gi, None, n)
        elif kind == "all_gather" and what == "sync_m":
            self.shim.tag(root.handle, _shim.TAG_SYNC_MOMENTUM, gi, None, n)
        elif kind == "all_gather" and what == "load_m":
            self.shim.tag(root.handle, _shim.TAG_LOAD_MOMENTUM, gi, None, n)
        elif kind == "reduce_scatter" and what == "rs":
            self.shim.tag(root.handle, _shim.TAG_REDUCE_SCATTER, gi, flags, n)
        elif kind == "all_reduce" and what == "rs":
            self.shim.tag(root.handle, _shim.TAG_REPLICATE, gi, flags, n)
        else:
            raise CompanionError(f"unexpected {kind} inside FSDP2's {what} of group {gi}")
        return True

    # ---- optimizer step ----------------------------------------------------------------

    def _hook_optimizer(self):
        import weakref

        from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
        comp = self
        # The lr each param group was created with: the "initial lr" of a job that sets
        # group["lr"] itself (no LRScheduler, which would record group["initial_lr"]).
        self._lr0 = weakref.WeakKeyDictionary()
        orig_add = Optimizer.add_param_group
        if not getattr(orig_add, "_mfsdp", False):
            def add_param_group(optimizer, param_group):
                orig_add(optimizer, param_group)
                lr = optimizer.param_groups[-1].get("lr")
                if lr is not None:
                    lr = float(lr.item() if hasattr(lr, "item") else lr)
                    comp._lr0.setdefault(optimizer, []).append(lr)
            add_param_group._mfsdp = True
            Optimizer.add_param_group = add_param_group

        def pre_step(optimizer, args, kwargs):
            comp.on_optimizer_step(optimizer)
        self._step_hook = register_optimizer_step_pre_hook(pre_step)

        # The owners hold the matrices' optimizer state (their Muon momentum): state_dict()
        # exports it as the matrices' momentum_buffer, load_state_dict() hands it back to the
        # owners at the next step (docs/pytorch.md, section 4).
        orig_load = Optimizer.load_state_dict
        if not getattr(orig_load, "_mfsdp", False):
            def load_state_dict(optimizer, state_dict):
                comp.on_optimizer_load(optimizer, state_dict)
                out = orig_load(optimizer, state_dict)
                comp.after_optimizer_load(optimizer)
                return out
            load_state_dict._mfsdp = True
            load_state_dict.__doc__ = orig_load.__doc__
            Optimizer.load_state_dict = load_state_dict
        orig_sd = Optimizer.state_dict
        if not getattr(orig_sd, "_mfsdp", False):
            def state_dict(optimizer):
                return comp.on_optimizer_state_dict(optimizer, orig_sd(optimizer))
            state_dict._mfsdp = True
            state_dict.__doc__ = orig_sd.__doc__
            Optimizer.state_dict = state_dict

        # zero_grad() without a step (a skipped batch, an inf check) must drop the owners'
        # gradients too: they would otherwise flow into the next step.
        orig_zero = Optimizer.zero_grad
        if not getattr(orig_zero, "_mfsdp", False):
            def zero_grad(optimizer, set_to_none=True):
                orig_zero(optimizer, set_to_none)
                comp.on_zero_grad((p for g in optimizer.param_groups for p in g["params"]),
                                  set_to_none, optimizer=optimizer)
            zero_grad._mfsdp = True
            zero_grad.__doc__ = orig_zero.__doc__
            Optimizer.zero_grad = zero_grad
        Module = self.torch.nn.Module
        orig_mzero = Module.zero_grad
        if not getattr(orig_mzero, "_mfsdp", False):
            def module_zero_grad(module, set_to_none=True):
                orig_mzero(module, set_to_none)
                comp.on_zero_grad(module.parameters(), set_to_none)
            module_zero_grad._mfsdp = True
            module_zero_grad.__doc__ = orig_mzero.__doc__
            Module.zero_grad = module_zero_grad

        # A GradScaler neither sees nor unscales the owners' gradients (they are not in the
        # params' .grad): its inf check and unscaling would be wrong for them.
        try:
            from torch.amp.grad_scaler import GradScaler
        except ImportError:  # pragma: no cover (torch without torch.amp)
            GradScaler = None
        orig_unscale = getattr(GradScaler, "unscale_", None)
        if orig_unscale is not None and not getattr(orig_unscale, "_mfsdp", False):
            def unscale_(scaler, optimizer):
                if comp.roots_of(p for g in optimizer.param_groups for p in g["params"]):
                    raise CompanionError(
                        "torch.amp.GradScaler on an optimizer of an FSDP2 root that mfsdp "
                        "trains: the owners' gradients are not in the params' .grad, so the "
                        "scaler can neither unscale them nor see their infs; train in bfloat16 "
                        "without a scaler, or run without mfsdp-run")
                return orig_unscale(scaler, optimizer)
            unscale_._mfsdp = True
            GradScaler.unscale_ = unscale_

    def roots_of(self, params):
        """The registered roots some of params belong to."""
        ids = {id(p) for p in params}
        return [r for r in self.roots if r is not None and not r.params.isdisjoint(ids)]

    def refuse_split_clip(self, name, tensors):
        """get_total_norm over the gradients, or clip_grads_with_norm_ over the params, of a root
        whose owners hold gradients the two never see: refused."""
        ids = {id(t) for t in tensors}
        for root in self.roots:
            if root is None or not root.owned:
                continue
            mine = {id(p) for p in root.module.parameters()}
            mine |= {id(p.grad) for p in root.module.parameters() if p.grad is not None}
            if not mine.isdisjoint(ids):
                raise CompanionError(
                    f"torch.nn.utils.{name} over the gradients of an FSDP2 root that mfsdp "
                    "trains: the owners' gradients are not among them, so the norm and the "
                    "clipping would leave them out; use torch.nn.utils.clip_grad_norm_, which "
                    "mfsdp extends to the owners")

    def on_zero_grad(self, params, set_to_none=True, optimizer=None):
        """zero_grad() of a module or an optimizer over params: drop the owners' gradients of
        each root whose owner-managed matrices are all among params; params holding none of
        them (the root's other params, a submodule without matrices) leave them alone; part
        of them is refused (the owners drop a root's gradients together)."""
        ids = {id(p) for p in params}
        for root in self.roots:
            if root is None or not root.owned:
                continue
            mine = root.owned & ids
            if not mine:
                continue
            if root.keep_next_zero and optimizer is not None:
                root.keep_next_zero = False  # DCP's own zero_grad after its skipped init step
                continue
            if mine != root.owned:
                raise CompanionError(
                    f"zero_grad() over {len(mine)} of the {len(root.owned)} owner-managed "
                    "matrices of an FSDP2 root: mfsdp drops the owners' gradients of a root "
                    "together; call zero_grad() on the root module or on the optimizer that "
                    "holds all its matrices")
            self.shim.zero_grads(root.handle)
            root.reduced.clear()
            root.zero_kept = not set_to_none
            root.stepped = False

    def _owned_in(self, root, optimizer):
        """The root's owned matrices the optimizer holds, in its param order."""
        return [p for g in optimizer.param_groups for p in g["params"] if id(p) in root.owned]

    def on_optimizer_load(self, optimizer, state_dict):
        """optimizer.load_state_dict(state_dict), before torch's load: the owners take a
        matrix's momentum_buffer (at the next step); other state for a matrix (a checkpoint
        of a run without mfsdp that trained it with AdamW) cannot become Muon momentum and is
        refused unless it is all zero (DCP's init step makes such zero state)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = [k for g in state_dict.get("param_groups", []) for k in g.get("params", [])]
        state = state_dict.get("state", {})
        for root in self.roots:
            if root is None or not root.owned:
                continue
            for i, p in enumerate(params):
                if id(p) not in root.owned or i >= len(saved):
                    continue
                entry = state.get(saved[i]) or {}
                foreign = sorted(k for k, v in entry.items() if k not in _OWNER_STATE and
                                 (bool(_local(v).any()) if hasattr(v, "any") else bool(v)))
                if foreign:
                    name = next((n for n, q in root.module.named_parameters() if q is p), "?")
                    raise CompanionError(
                        f"optimizer.load_state_dict: the state holds {foreign} for "
                        f"owner-managed matrix {name} (a checkpoint of a run without mfsdp?); "
                        "mfsdp's owners step the matrices with Muon and take only a "
                        "momentum_buffer (torch.optim.Muon's state): drop the matrices' "
                        "other entries from state_dict['state'] to restart their momentum "
                        "from zero")

    def after_optimizer_load(self, optimizer):
        """After torch's load: the owners take the loaded momentum (none: zero) at the next
        step; until then the job's optimizer holds it (and its state_dict() shows it)."""
        for root in self.roots:
            if root is None or not root.owned:
                continue
            mine = self._owned_in(root, optimizer)
            if not mine:
                continue
            root.load_pending = True
            root.has_state = {id(p) for p in mine
                              if "momentum_buffer" in optimizer.state.get(p, {})}

    def on_optimizer_state_dict(self, optimizer, sd):
        """optimizer.state_dict(): the owners' Muon momentum of the matrices torch would hold
        state for, as each matrix's momentum_buffer (a tensor sharded as the param, its dtype),
        as torch.optim.Muon keeps it; for another optimizer also the matrix's "step" (the
        steps it had a gradient at), which torch's Adam family requires of every state entry.
        Collective over the shard group when the owners hold non-zero momentum: call
        state_dict() on every rank (DCP does)."""
        torch = self.torch
        cls = self._muon_class()
        with_step = cls is None or not isinstance(optimizer, cls)
        for root in self.roots:
            if root is None or not root.owned:
                continue
            bound = root.optimizer() if root.optimizer is not None else None
            if bound is not optimizer:
                continue  # the owners' state is that of the optimizer that stepped them
            index = {}
            for group, sgroup in zip(optimizer.param_groups, sd["param_groups"]):
                for p, k in zip(group["params"], sgroup["params"]):
                    if id(p) in root.has_state and \
                            "momentum_buffer" not in optimizer.state.get(p, {}):
                        index[id(p)] = k
            if not index:
                continue
            # A loaded state (or a new optimizer) the owners take at the next step: torch's own
            # state_dict shows what it loaded; a matrix it holds none for restarts from zero.
            live = root.momentum_live and not root.load_pending
            with torch.no_grad():
                for gi, (g, _) in enumerate(root.layout):
                    mine = [(i, fp) for i, fp in enumerate(g.fsdp_params)
                            if id(fp.sharded_param) in index]
                    if not mine:
                        continue
                    block = self._exchange("sync_m", root, gi) if live else None
                    offsets, _ = self._block_offsets(g)
                    for i, fp in mine:
                        p = fp.sharded_param
                        buf = torch.zeros_like(p, requires_grad=False)
                        if block is not None:
                            local = _local(buf)
                            local.copy_(block.narrow(0, offsets[i], local.numel())
                                        .view(local.shape))
                        k = index[id(p)]
                        entry = dict(sd["state"].get(k, {}))
                        entry["momentum_buffer"] = buf
                        if with_step:
                            entry["step"] = torch.tensor(float(root.steps.get(id(p), 0)))
                        sd["state"][k] = entry
        return sd

    @staticmethod
    def _block_offsets(g):
        """(element offset of each param, size) of group g's FSDP block in fp32: FSDP2's
        padded shards, in param order (the layout of the shim's tagged exchanges)."""
        offsets, total = [], 0
        for fp in g.fsdp_params:
            offsets.append(total)
            total += fp._sharded_param_data.numel()
        return offsets, total

    def _exchange(self, what, root, gi, block=None):
        """One tagged float32 all-gather of group gi's FSDP blocks, which the shim turns into
        an exchange with the owners: "sync" (weights) and "sync_m" (momentum) return this
        rank's block filled by the owners (zeros where they write nothing); "load_m" sends
        `block` (this rank's rows) to the owners, which take it as their momentum."""
        torch = self.torch
        g = root.layout[gi][0]
        pg = g.mesh_info.shard_process_group
        ws, rank = pg.size(), pg.rank()
        _, total = self._block_offsets(g)
        if block is not None:  # the output is not written: no need to clear it
            out = torch.empty(total * ws, dtype=torch.float32, device=g.device)
            self._all_gather(what, root, gi, out, block, pg)
            return block
        out = torch.zeros(total * ws, dtype=torch.float32, device=g.device)
        mine = out.narrow(0, total * rank, total)
        self._all_gather(what, root, gi, out, mine, pg)
        return mine

    def _push_momentum(self, root, optimizer, owned):
        """Hand the momentum_buffer entries of the owned matrices `owned` in the job's
        optimizer (a loaded state; zero where none) to the owners and drop them from the
        optimizer."""
        torch = self.torch
        ids = {id(p) for p in owned}
        names = None
        with torch.no_grad():
            for gi, (g, _) in enumerate(root.layout):
                mine = [(i, fp) for i, fp in enumerate(g.fsdp_params)
                        if id(fp.sharded_param) in ids]
                if not mine:
                    continue
                offsets, total = self._block_offsets(g)
                block = torch.zeros(total, dtype=torch.float32, device=g.device)
                for i, fp in mine:
                    p = fp.sharded_param
                    buf = optimizer.state.get(p, {}).get("momentum_buffer")
                    if buf is None:
                        continue
                    local, want = _local(buf), _local(p)
                    if local.shape != want.shape or (hasattr(buf, "placements") and
                                                     buf.placements != p.placements):
                        if names is None:
                            names = {id(q): n for n, q in root.module.named_parameters()}
                        raise CompanionError(
                            f"the momentum_buffer loaded for owner-managed matrix "
                            f"{names.get(id(p), '?')} is {type(buf).__name__} "
                            f"{tuple(local.shape)} on this rank, its FSDP2 shard "
                            f"{tuple(want.shape)}: load the optimizer state as the sharded "
                            "state dict it was saved as (DCP, or set_optimizer_state_dict), "
                            "not a full or differently sharded one")
                    block.narrow(0, offsets[i], local.numel()).copy_(local.reshape(-1))
                self._exchange("load_m", root, gi, block)
        if root.load_pending:
            root.steps = {}
        for p in owned:
            entry = optimizer.state.get(p)
            if entry is not None and "momentum_buffer" in entry:
                root.has_state.add(id(p))
                del entry["momentum_buffer"]
                step = entry.pop("step", None)
                if step is not None:
                    root.steps[id(p)] = int(_num(step))
                if not entry:
                    del optimizer.state[p]
        root.load_pending = False
        root.momentum_live = True

    def on_optimizer_step(self, optimizer):
        for root in self.roots:
            if root is None:
                continue
            # The optimizer that holds the root's matrices steps the owners (an optimizer of the
            # root's other params only, say AdamW beside torch.optim.Muon, does not).
            keys = root.owned or root.params
            factor = None
            for i, group in enumerate(optimizer.param_groups):
                if not any(id(p) in keys for p in group["params"]):
                    continue
                f = self._lr_factor(optimizer, i, group)
                if factor is None:
                    factor = f
                elif abs(f - factor) > 1e-12 * max(1.0, abs(factor)):
                    raise CompanionError(
                        f"the optimizer's param groups that hold the root's matrices follow "
                        f"different lr schedules ({factor} vs {f} of the initial lr); mfsdp's "
                        "owners follow one")
            if factor is None:
                continue
            self._check_optimizer(root, optimizer)
            if self._stray_grads(root, optimizer, factor):
                continue
            for gi in sorted(root.loaded):
                if any(id(fp.sharded_param) in root.reduced
                       for fp in root.layout[gi][0].fsdp_params):
                    raise CompanionError(
                        f"group {root.manifest['groups'][gi]['name']!r}: weights loaded "
                        "(load_state_dict, set_model_state_dict, DCP's load) between the "
                        "backward and optimizer.step(): mfsdp's owners take loaded weights at "
                        "the group's next all-gather, so they cannot step them with this "
                        "step's gradients; load before the forward or after the step")
            if root.stepped:
                raise CompanionError(
                    "optimizer.step() over the owner-managed matrices again with no zero_grad() "
                    "since the last one: torch would step them again with the gradients their "
                    ".grad keeps, mfsdp's owners used theirs at the last step; call zero_grad() "
                    "(of the optimizer or the model) between two steps")
            if root.zero_kept and root.owned - root.reduced:
                names = [n for n, p in root.module.named_parameters()
                         if id(p) in root.owned - root.reduced]
                raise CompanionError(
                    f"{len(names)} owner-managed matrices (e.g. {names[0] if names else '?'}) got "
                    "no gradient this step after zero_grad(set_to_none=False): torch's optimizer "
                    "would step them with the zero gradient it keeps (momentum, weight decay), "
                    "mfsdp's owners skip a matrix without gradient; use zero_grad() "
                    "(set_to_none=True, the default)")
            owned = self._owned_in(root, optimizer)
            if root.load_pending or any("momentum_buffer" in optimizer.state.get(p, {})
                                        for p in owned):
                # a loaded optimizer state (a resume, a rollback) or a new optimizer: the
                # owners take its momentum (zero where it holds none) before they step
                self._push_momentum(root, optimizer, owned)
            self.shim.step(root.handle, factor)
            root.has_state |= root.reduced  # torch makes a matrix's state at its first step
            for i in root.reduced:
                root.steps[i] = root.steps.get(i, 0) + 1
            root.stepped = bool(root.reduced)  # a step with no gradient keeps none either
            root.momentum_live |= root.stepped
            root.reduced.clear()
            root.dirty = True
            if root.manifest["world_size"] == 1:
                # FSDP2's next one-rank unshard copies the local shards: they must hold the
                # owners' new weights before the next forward.
                self.sync(root)

    def _stray_grads(self, root, optimizer, factor):
        """Owner-managed matrices never carry a .grad at a step (the owners hold their
        gradients): one that does was set outside FSDP2's reduce-scatter. DCP's
        get_optimizer_state_dict on an optimizer without state does so, zero gradients at lr
        0, to build the state: that step is skipped for the owners (their real gradients
        kept, as plain torch keeps them) and its matrices are left out of the job's step (on
        a GPU torch.optim.Muon's Newton-Schulz over FSDP2 shards would issue collectives on the
        communicator mfsdp manages). True when the step is such a skipped one."""
        stray = [p for g in optimizer.param_groups for p in g["params"]
                 if id(p) in root.owned and p.grad is not None]
        if not stray:
            return False
        local = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in stray)]
        if factor == 0.0 and not any(bool(t.any()) for t in local):
            for p in stray:
                p.grad = None
                root.has_state.add(id(p))  # torch's init step gives it (zero) state
            root.keep_next_zero = True
            return True
        name = next((n for n, p in root.module.named_parameters() if p is stray[0]), "?")
        raise CompanionError(
            f"owner-managed matrix {name} has a .grad that FSDP2's reduce-scatter did not leave "
            "(mfsdp's owners hold these gradients and never see .grad): do not set .grad of "
            "the matrices mfsdp trains")

    def _check_optimizer(self, root, optimizer):
        """The owners step every trainable matrix of the root at once, with one lr factor: the
        root's matrices must be stepped by one optimizer that holds them all; when it is
        torch.optim.Muon, with the hyper-parameters registered from it."""
        import weakref
        cls = self._muon_class()
        is_muon = cls is not None and isinstance(optimizer, cls)
        bound = root.optimizer() if root.optimizer is not None else None
        if bound is optimizer:
            if is_muon:
                self._check_muon_unchanged(root, optimizer)
            return
        if bound is not None:
            raise CompanionError(
                "two optimizers step matrices of one FSDP2 root that mfsdp trains; its owners "
                "step every matrix of the root at once with one lr factor: put the root's "
                "matrices in one optimizer (torch.optim.Muon, or the one of the other params; "
                "the other params may have optimizers of their own)")
        if root.optimizer is not None:
            # a new optimizer after the one that stepped the owners is gone: torch starts its
            # state fresh, so do the owners (zero momentum, or what it loaded, at this step)
            root.load_pending = True
            root.has_state = set()
            root.steps = {}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = root.owned - held
        other = [o for o in list(getattr(self, "_lr0", {}).keys()) if o is not optimizer and
                 any(id(p) in missing for g in o.param_groups for p in g["params"])]
        if missing and other:
            raise CompanionError(
                f"two optimizers step matrices of one FSDP2 root that mfsdp trains (this "
                f"{type(optimizer).__name__} and another {type(other[0]).__name__}); its owners step "
                "every matrix of the root at once with one lr factor: put the root's matrices "
                "in one optimizer")
        if missing:
            names = [n for n, p in root.module.named_parameters() if id(p) in missing]
            raise CompanionError(
                f"{len(missing)} trainable matrices of the FSDP2 root are in no param group of "
                f"the optimizer that steps it (e.g. {names[0] if names else '?'}); mfsdp's owners "
                "step every trainable matrix: add it to the optimizer, or freeze it "
                "(requires_grad=False) before the first forward")
        if is_muon:
            tail = [n for n, p in root.module.named_parameters()
                    if id(p) in held and id(p) in root.params and id(p) not in root.owned and
                    p.requires_grad]
            if tail:
                raise CompanionError(
                    f"torch.optim.Muon also holds {tail[0]}, a param mfsdp leaves to the job "
                    "(an embedding, the output projection, a match of MFSDP_PY_ADAMW): torch's Newton-Schulz on its FSDP2 shards would issue collectives "
                    "on the communicator mfsdp manages; give it to the job's other optimizer "
                    "(AdamW, as Muon's authors do)")
            if root.muon_hp is None:
                raise CompanionError(
                    "torch.optim.Muon steps the matrices of an FSDP2 root, but it did not exist "
                    "at the root's first forward, when mfsdp registered the owners' Muon "
                    "hyper-parameters (its defaults and MFSDP_*): create the optimizer before "
                    "the first forward (after importing torch.distributed.fsdp)")
            self._check_muon_unchanged(root, optimizer)  # a new one with the same values is ok
            root.muon = weakref.ref(optimizer)
        elif root.muon_hp is None and not os.environ.get("MFSDP_LR") and any(
                "muon" in c.__name__.lower() for c in type(optimizer).__mro__):
            # Another Muon (Keller Jordan's MuonWithAuxAdam, a framework's own): its
            # hyper-parameters are not readable here, and mfsdp's defaults would replace them.
            raise CompanionError(
                f"{type(optimizer).__name__} steps the matrices of an FSDP2 root: mfsdp's owners "
                "run their own Muon with the MFSDP_* hyper-parameters (lr 0.02, momentum 0.95, "
                "Nesterov, weight decay 0, keller scale unless set), not this optimizer's, "
                "which mfsdp cannot read; set MFSDP_LR (and MFSDP_MOMENTUM, "
                "MFSDP_WEIGHT_DECAY, MFSDP_SCALE, ... where they differ) to say which apply, or "
                "use torch.optim.Muon, whose values mfsdp takes")
        elif root.muon_hp is not None:
            raise CompanionError(
                f"{type(optimizer).__name__} steps the matrices of an FSDP2 root whose Muon "
                "hyper-parameters mfsdp registered from a torch.optim.Muon over them: step the "
                "matrices with that torch.optim.Muon")
        root.optimizer = weakref.ref(optimizer)

    def _lr_factor(self, optimizer, i, group):
        return _num(group["lr"]) / self._initial_lr(optimizer, i, group)

    def _initial_lr(self, optimizer, i, group):
        lr = _num(group["lr"])
        created = getattr(self, "_lr0", {}).get(optimizer, [])
        if "initial_lr" in group:  # set by every torch LRScheduler
            init = group["initial_lr"]
        elif i < len(created):  # the lr the group was created with
            init = created[i]
        else:  # created before the companion was loaded: its lr at the first step
            seen = optimizer.__dict__.setdefault("_mfsdp_initial_lr", {})
            init = seen.setdefault(i, lr)
        init = _num(init)
        if init <= 0:
            raise CompanionError(f"optimizer param group {i}: initial lr {init} is not > 0")
        return init

    # ---- gradient clipping -------------------------------------------------------------

    def clip(self, orig, parameters, max_norm, norm_type, error_if_nonfinite, foreach):
        torch = self.torch
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        roots = self.roots_of(parameters)
        if not roots:
            return orig(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        if len(roots) > 1:
            raise CompanionError("clip_grad_norm_ over params of two FSDP2 roots")
        root = roots[0]
        # The shim's norm and scale cover every owner-managed gradient of the root: a clip
        # over part of them would fold the others into the norm and scale them too.
        left_out = root.owned - {id(p) for p in parameters}
        if left_out:
            raise CompanionError(
                f"clip_grad_norm_ over part of an FSDP2 root's params: {len(left_out)} of its "
                f"{len(root.owned)} owner-managed matrices are not among them, and mfsdp "
                "computes and scales the owners' gradients of a root together; clip all of "
                "the root's params in one call")
        if float(norm_type) != 2.0:
            raise CompanionError(f"clip_grad_norm_(norm_type={norm_type}): mfsdp includes the "
                                 "owners' gradients for the 2-norm only")
        from torch.distributed.tensor import DTensor
        grads = [p.grad for p in parameters if p.grad is not None]
        dev = root.layout[0][0].device
        norms = []
        for gr in grads:
            if not isinstance(gr, DTensor):
                raise CompanionError("clip_grad_norm_: a gradient that FSDP2 does not shard "
                                     "(not a DTensor) next to owner-managed params")
            norms.append(torch.linalg.vector_norm(gr.to_local(), 2, dtype=torch.float32))
        # One device tensor, one host sync (the .item() after the all-reduce).
        total_sq = torch.full((), self.shim.grad_sqnorm(root.handle), dtype=torch.float64,
                              device=dev)
        if norms:
            total_sq += torch.stack(norms).to(dev).double().square().sum()
        # Every FSDP2 shard holds a disjoint slice and every owner a disjoint tensor: one sum
        # over the shard group is the global squared norm (HSDP replicas hold equal copies).
        self.dist.all_reduce(total_sq, group=root.shard_group)
        total = math.sqrt(float(total_sq.item()))
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped. To disable "
                               "this error and scale the gradients by the non-finite norm anyway, "
                               "set `error_if_nonfinite=False`")
        coef = min(float(max_norm) / (total + 1e-6), 1.0)
        for gr in grads:
            gr.mul_(coef)
        self.shim.scale_grads(root.handle, coef)
        return torch.tensor(total, dtype=grads[0].dtype if grads else torch.float32, device=dev)

    # ---- checkpoints -------------------------------------------------------------------

    def _hook_state_dict(self, root):
        comp = self
        # Every module of the root (the FSDP2 groups' modules are among them), not only the
        # groups': a submodule inside a group (model.blocks[0].attn) has its own state_dict()
        # and load_state_dict(), which run only its own subtree's hooks.
        modules = list(root.module.modules())

        def pre_hook(module, prefix, keep_vars):
            comp.sync(root)
        for m in modules:
            m.register_state_dict_pre_hook(pre_hook)

        # load_state_dict (set_model_state_dict, a checkpoint loaded mid-run) writes the
        # shards: the owners take their weights from them again, and the shards are the truth
        # until the next step (no write-back over them). The owners' weights are written back
        # first, so that a load of part of the params (strict=False, one submodule) leaves
        # the others as trained, not as they were at the last write-back.
        # set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True) copies the
        # loaded values into the shards before it calls load_state_dict: the write-back
        # leaves a shard written since the owners took it as it is (the load writes it).
        def pre_load(module, *args):
            comp.sync(root, loading=True)  # idempotent: a load of the root runs every hook

        def post_load(module, incompatible):
            comp.reload(root)
        for m in modules:
            m.register_load_state_dict_pre_hook(pre_load)
            m.register_load_state_dict_post_hook(post_load)

    def roots_sharing(self, tensors):
        """The registered roots with an owner-managed shard whose storage one of tensors
        (DTensors: their local tensors) shares."""
        ptrs = set()
        for t in tensors:
            t = _local(t)
            try:
                ptrs.add(t.untyped_storage().data_ptr())
            except (AttributeError, RuntimeError):
                continue
        found = []
        for root in self.roots:
            if root is None:
                continue
            for g, _ in root.layout:
                if any(id(fp.sharded_param) in root.owned and
                       fp._sharded_param_data.untyped_storage().data_ptr() in ptrs
                       for fp in g.fsdp_params):
                    found.append(root)
                    break
        return found

    def reload(self, root):
        self.shim.reload(root.handle)
        root.dirty = False
        root.versions.clear()  # the shards are the truth until the owners take them again
        if root.manifest["world_size"] > 1:
            root.loaded = set(root.gathered)
        if root.manifest["world_size"] == 1:
            self._one_rank_fill(root)  # FSDP2 issues no all-gather on one rank

    def sync(self, root, loading=False):
        """Write the owners' weights into the job's local shards (collective over the
        shard group; every rank of the job calls state_dict() at the same point). loading:
        right before a load (load_state_dict's pre-hook), where a shard written in place since
        the owners took it is being loaded: it is kept, not refused."""
        if root is None or not root.dirty:
            return
        torch = self.torch
        with torch.no_grad():
            for gi, (g, roles) in enumerate(root.layout):
                owned = [i for i, fp in enumerate(g.fsdp_params)
                         if id(fp.sharded_param) in root.owned]
                if not owned or gi not in root.gathered:
                    # a group never gathered (never run forward): the owners have no weights
                    # and never stepped it; the job's shards hold its weights
                    continue
                keep = set()
                if loading:
                    keep = {i for i, fp in enumerate(g.fsdp_params)
                            if self._written_since(root, fp)}
                else:
                    self._check_versions(root, gi, "the write-back of the owners' weights "
                                         "(state_dict(), mfsdp.sync_weights(), a one-rank "
                                         "step) would overwrite it")
                mine = self._exchange("sync", root, gi)
                offsets, _ = self._block_offsets(g)
                for i in owned:
                    if i in keep:
                        continue  # every rank joins the all-gather; this one keeps its shard
                    shard = g.fsdp_params[i]._sharded_param_data
                    shard.copy_(mine.narrow(0, offsets[i], shard.numel()))
                self._record_versions(root, gi)
        root.dirty = False


_NCCL_NAME = {"all_gather": "ncclAllGather", "reduce_scatter": "ncclReduceScatter",
              "all_reduce": "ncclAllReduce"}


class _DistProxy:
    """Stands for torch.distributed inside _fsdp_collectives: tags FSDP2's collectives."""

    def __init__(self, inner, companion):
        self.__dict__["_inner"] = inner
        self.__dict__["_comp"] = companion

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def _call(self, kind, fn, *args, **kwargs):
        tagged = self._comp.tag_for(kind)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            if tagged:
                try:
                    self._comp.shim.untag()
                except Exception:  # the original error is the one to report
                    pass
            raise
        if tagged and self._comp.shim.tag_pending():
            # The collective returned without reaching the shim's NCCL interposer: the
            # owners took no part, so this step's gradients or weights would be wrong.
            self._comp.shim.untag()
            what, entry = kind.replace("_", "-"), getattr(fn, "__name__", kind)
            raise CompanionError(
                f"FSDP2's {what} returned without reaching the mfsdp shim "
                f"(torch.distributed.{entry} did not call NCCL's "
                f"{_NCCL_NAME[kind]}: a process group that is not NCCL, or one that serves "
                "the call without NCCL); mfsdp cannot train this job")
        return out

    def all_gather_single(self, *args, **kwargs):
        return self._call("all_gather", self._inner.all_gather_single, *args, **kwargs)

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._call("all_gather", self._inner.all_gather_into_tensor, *args, **kwargs)

    def reduce_scatter_single(self, *args, **kwargs):
        return self._call("reduce_scatter", self._inner.reduce_scatter_single, *args, **kwargs)

    def reduce_scatter_tensor(self, *args, **kwargs):
        return self._call("reduce_scatter", self._inner.reduce_scatter_tensor, *args, **kwargs)

    def all_reduce(self, *args, **kwargs):
        return self._call("all_reduce", self._inner.all_reduce, *args, **kwargs)


def patch_clip(clip_mod):
    """Replace torch.nn.utils.clip_grad.clip_grad_norm_ (run as soon as that module has
    executed, inside `import torch`, so that `from torch.nn.utils import clip_grad_norm_` in
    the job already binds the replacement). It is the original unless the norm covers
    params of a registered FSDP2 root."""
    orig = clip_mod.clip_grad_norm_
    if getattr(orig, "_mfsdp", False):
        return

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        foreach=None):
        comp = _installed
        if comp is None or comp.mode != "tag":
            return orig(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        return comp.clip(orig, parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    clip_grad_norm_._mfsdp = True
    clip_grad_norm_.__doc__ = orig.__doc__
    clip_grad_norm_.__wrapped__ = orig
    clip_mod.clip_grad_norm_ = clip_grad_norm_
    utils = sys.modules.get("torch.nn.utils")
    if utils is not None and getattr(utils, "clip_grad_norm_", None) is orig:
        utils.clip_grad_norm_ = clip_grad_norm_


def patch_split_clip(utils):
    """Replace torch.nn.utils.get_total_norm and clip_grads_with_norm_ (the split form of
    clipping torchtitan uses; run once torch.nn.utils has executed): a norm and a scaling that
    never see the owners' gradients are refused over params of a registered root."""
    for name in ("get_total_norm", "clip_grads_with_norm_"):
        f = getattr(utils, name, None)
        if f is not None and not getattr(f, "_mfsdp", False):
            setattr(utils, name, _refusing(f, name))


def patch_dcp_load(loader):
    """Wrap torch.distributed.checkpoint's load (run once state_dict_loader has executed,
    before the package binds its names): DCP loads in place, into the tensors of the state
    dict it is given, which for model.state_dict() are the job's shards themselves. Loading
    there without a model.load_state_dict() after it (plain FSDP2 needs none) would leave the
    owners with their own weights; so the owners' weights are written back first (a load of
    part of them leaves the others as trained) and the owners take the shards again after."""
    for name in ("load", "load_state_dict"):
        f = getattr(loader, name, None)
        if f is not None and not getattr(f, "_mfsdp", False):
            setattr(loader, name, _dcp_wrapped(f, load=True))


def patch_dcp_save(saver):
    """Wrap torch.distributed.checkpoint's save (run once state_dict_saver has executed):
    a state dict taken once and saved later (torchtitan's ModelWrapper caches
    get_model_state_dict's) holds the job's shards, which hold the owners' weights only after
    a write-back; state_dict() runs one, a cached dict's save does not: the save does."""
    for name in ("save", "save_state_dict", "async_save"):
        f = getattr(saver, name, None)
        if f is not None and not getattr(f, "_mfsdp", False):
            setattr(saver, name, _dcp_wrapped(f, load=False))


def patch_dcp_state_dict(module):
    """Wrap torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict and
    get/set_state_dict (run once that module has executed): a resume calls them before the
    first forward, where mfsdp registers the model. Their init step of an optimizer without
    state (zero gradients at lr 0) would then give the matrices the job optimizer's own state
    (AdamW's exp_avg, ...), which a checkpoint saved under mfsdp does not hold (it holds the
    owners' momentum): DCP would stop with "Missing key". The FSDP2 root given as `model` is
    registered first (FSDP2's lazy init, which its first forward would run)."""
    for name in ("get_optimizer_state_dict", "set_optimizer_state_dict", "get_state_dict",
                 "set_state_dict"):
        f = getattr(module, name, None)
        if f is not None and not getattr(f, "_mfsdp", False):
            setattr(module, name, _registering(f))


def _registering(f):
    def wrapper(model, *args, **kwargs):
        comp = _installed
        get_state = getattr(model, "_get_fsdp_state", None)
        if comp is not None and comp.mode == "tag" and get_state is not None:
            state = get_state()
            if state._is_root is None:
                state._lazy_init()  # registers the root (the companion's lazy-init hook)
        return f(model, *args, **kwargs)
    wrapper._mfsdp = True
    wrapper.__doc__ = f.__doc__
    wrapper.__wrapped__ = f
    return wrapper


def _dcp_roots(comp, state_dict):
    """The registered roots a DCP save or load of state_dict may touch: those with an
    owner-managed shard among its tensors; every root when it holds a Stateful object (DCP
    calls its state_dict(), which may return a cached dict of the shards, and its
    load_state_dict())."""
    if comp is None or comp.mode != "tag":
        return []
    tensors, stateful = _tensors_in(state_dict)
    if stateful:
        return [r for r in comp.roots if r is not None]
    return comp.roots_sharing(tensors)


def _dcp_wrapped(f, load):
    def wrapper(state_dict, *args, **kwargs):
        comp = _installed
        roots = _dcp_roots(comp, state_dict)
        for root in roots:
            comp.sync(root)
        out = f(state_dict, *args, **kwargs)
        if load:
            for root in roots:
                comp.reload(root)
        return out
    wrapper._mfsdp = True
    wrapper.__doc__ = f.__doc__
    wrapper.__wrapped__ = f
    return wrapper


def _tensors_in(obj, depth=0):
    """(the tensors in a nested state dict, whether it holds a Stateful object: anything with
    state_dict and load_state_dict that is not a tensor, a dict, a list or a tuple)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return [obj], False
    if depth > 16:
        return [], False
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        return [], hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
    found, stateful = [], False
    for v in items:
        t, s = _tensors_in(v, depth + 1)
        found += t
        stateful = stateful or s
    return found, stateful


def _refusing(f, name):
    def wrapper(tensors, *args, **kwargs):
        comp = _installed
        if comp is not None and comp.mode == "tag":
            import torch
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            comp.refuse_split_clip(name, tensors)
        return f(tensors, *args, **kwargs)
    wrapper._mfsdp = True
    wrapper.__doc__ = f.__doc__
    wrapper.__wrapped__ = f
    return wrapper


def install(shim=None, mode=None):
    """Hook the imported FSDP2 (idempotent). mode "tag" (mfsdp-run: needs the shim) or
    "manifest" (python -m mfsdp.manifest: only writes the manifest)."""
    global _installed
    if _installed is not None:
        return _installed
    mode = mode or os.environ.get("MFSDP_COMPANION", "tag")
    if mode not in ("tag", "manifest"):
        raise CompanionError(f"MFSDP_COMPANION={mode!r}: expected tag or manifest")
    if mode == "tag" and shim is None:
        shim = _shim.load()
    _installed = Companion(shim, mode)
    return _installed


def sync_weights(module=None):
    """Write the owners' weights into the job's shards now (state_dict() does this itself).
    Collective: call it on every rank."""
    if _installed is None:
        return
    for root in _installed.roots:
        if root is not None and (module is None or root.module is module):
            _installed.sync(root)


__all__ = ["CompanionError", "ManifestError", "install", "sync_weights"]
