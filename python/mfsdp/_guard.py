# SPDX-License-Identifier: Apache-2.0
"""Which torch FSDP2 the companion knows, checked without importing torch (mfsdp-run) and
again on the live modules (in the job).

The companion hooks private FSDP2 functions; their names and signatures change between
releases, so an unknown release is refused rather than hooked on a guess.
"""
import importlib.util
import inspect
import os
import re

# What the companion relies on in each torch release it knows: the torch.distributed
# entry points FSDP2's collectives call (the ones the companion tags), source markers of the
# FSDP2 code paths the hooks rely on, and the leading parameters of the hooked functions as
# the hooks call them. Read from each release's own torch/distributed/fsdp/_fully_shard.
_COMMON_MARKERS = {
    "_fsdp_collectives.py": ["def foreach_all_gather(", "def foreach_reduce(",
                             "dist.all_reduce("],
    "_fsdp_param_group.py": ["foreach_all_gather(", "foreach_reduce("],
    "_fsdp_state.py": ["def _lazy_init(self)", "all_states"],
}
_AG_SIGNATURE = ["fsdp_params", "group", "async_op", "all_gather_copy_in_stream",
                 "all_gather_stream", "device", "all_gather_comm"]


def _markers(collectives, param_group=()):
    m = {k: list(v) for k, v in _COMMON_MARKERS.items()}
    m["_fsdp_collectives.py"] += list(collectives)
    m["_fsdp_param_group.py"] += list(param_group)
    return m


KNOWN = {
    # 2.15: functional-collective style calls; the reduce-scatter packs params grouped by
    # gradient dtype (_reduce_scatter_param_indices).
    (2, 15): {
        "all_gather": "all_gather_single",
        "reduce_scatter": "reduce_scatter_single",
        "markers": _markers(["dist.all_gather_single(", "dist.reduce_scatter_single("],
                            ["_reduce_scatter_param_indices"]),
        "signatures": {
            "foreach_all_gather": _AG_SIGNATURE,
            "foreach_reduce": ["fsdp_params", "unsharded_grads", "reduce_scatter_group",
                               "reduce_scatter_stream", "reduce_scatter_comm", "reduce_dtype",
                               "device", "gradient_divide_factor", "all_reduce_group"],
        },
    },
    # 2.11: the older all_gather_into_tensor / reduce_scatter_tensor calls; foreach_reduce
    # takes orig_dtype before reduce_dtype; the reduce-scatter packs params in group order.
    (2, 11): {
        "all_gather": "all_gather_into_tensor",
        "reduce_scatter": "reduce_scatter_tensor",
        "markers": _markers(["dist.all_gather_into_tensor(", "dist.reduce_scatter_tensor("]),
        "signatures": {
            "foreach_all_gather": _AG_SIGNATURE,
            "foreach_reduce": ["fsdp_params", "unsharded_grads", "reduce_scatter_group",
                               "reduce_scatter_stream", "reduce_scatter_comm", "orig_dtype",
                               "reduce_dtype", "device", "gradient_divide_factor",
                               "all_reduce_group"],
        },
    },
}


class UnknownTorch(RuntimeError):
    """The installed torch's FSDP2 is not one the companion knows."""


def parse_version(text):
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise UnknownTorch(f"cannot read the torch version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def known_list():
    return ", ".join(f"{a}.{b}" for a, b in sorted(KNOWN))


def check_version(text):
    v = parse_version(text)
    if v not in KNOWN:
        raise UnknownTorch(
            f"torch {text}: its FSDP2 is not a version mfsdp knows (known: {known_list()}); "
            "the companion hooks FSDP2 internals that change between releases and will not "
            "guess")
    return v


def check_installed():
    """Check the torch that `import torch` would load, without importing it.

    Returns (version text, torch package directory)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise UnknownTorch("torch is not installed for this Python (mfsdp-run needs the "
                           "Python that runs the job)")
    root = list(spec.submodule_search_locations)[0]
    vfile = os.path.join(root, "version.py")
    try:
        with open(vfile) as f:
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError as e:
        raise UnknownTorch(f"cannot read {vfile}: {e}") from None
    if m is None:
        raise UnknownTorch(f"{vfile} holds no __version__")
    text = m.group(1)
    entry = KNOWN[check_version(text)]
    fsdp = os.path.join(root, "distributed", "fsdp", "_fully_shard")
    for fname, markers in entry["markers"].items():
        path = os.path.join(fsdp, fname)
        try:
            with open(path) as f:
                src = f.read()
        except OSError as e:
            raise UnknownTorch(f"torch {text}: FSDP2 source {path} is missing ({e})") from None
        for marker in markers:
            if marker not in src:
                raise UnknownTorch(
                    f"torch {text}: {path} lacks {marker!r}; this FSDP2 is not the one mfsdp "
                    f"knows for {text}")
    return text, root


def check_live(torch_module, collectives, param_group, state):
    """Check the imported FSDP2 modules; returns the KNOWN entry of this release."""
    entry = KNOWN[check_version(torch_module.__version__)]
    dist = collectives.dist
    for name in (entry["all_gather"], entry["reduce_scatter"]):
        if not callable(getattr(dist, name, None)):
            raise UnknownTorch(f"torch {torch_module.__version__}: torch.distributed.{name} "
                               "is missing")
    for fn, want in entry["signatures"].items():
        params = list(inspect.signature(getattr(collectives, fn)).parameters)
        if params[:len(want)] != want:
            raise UnknownTorch(f"torch {torch_module.__version__}: {fn}{tuple(params)} is not "
                               f"the signature mfsdp hooks ({', '.join(want)}, ...)")
        if getattr(param_group, fn, None) is not getattr(collectives, fn):
            raise UnknownTorch(f"torch {torch_module.__version__}: _fsdp_param_group does not "
                               f"call _fsdp_collectives.{fn}")
    for attr in ("_lazy_init",):
        if not callable(getattr(state.FSDPState, attr, None)):
            raise UnknownTorch(f"torch {torch_module.__version__}: FSDPState.{attr} missing")
    return entry
