#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the companion's pieces that need no FSDP2 job (`check.py units`): the ctypes
shim binding against stand-in libraries (absent shim, other ABI, missing functions, error
messages, flag encoding), the torch version guard, the shim search and environment of
mfsdp-run, and the sitecustomize chaining of the path hook. Prints "units: N ok"."""
import os
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
PYPKG = os.path.join(HERE, "..", "..", "python")
sys.path.insert(0, PYPKG)
from mfsdp import _guard, _shim, run  # noqa: E402

passed = 0


def ok(name):
    global passed
    passed += 1
    print(f"ok: {name}")


def raises(exc, words, fn, *a, **kw):
    try:
        fn(*a, **kw)
    except exc as e:
        for w in words:
            if w not in str(e):
                raise SystemExit(f"FAIL: {fn.__name__}: message lacks {w!r}: {e}")
        return str(e)
    raise SystemExit(f"FAIL: {fn.__name__} did not raise {exc.__name__}")


class Fn:
    """Stands for a ctypes function: records calls, returns a fixed value."""

    def __init__(self, ret, log=None, name=""):
        self.ret, self.log, self.name = ret, log, name

    def __call__(self, *args):
        if self.log is not None:
            self.log.append((self.name,) + args)
        return self.ret(*args) if callable(self.ret) else self.ret


def lib(abi=3, drop=(), rc=0, err=b"", log=None):
    names = ["mfsdp_shim_register", "mfsdp_shim_tag", "mfsdp_shim_untag", "mfsdp_shim_step",
             "mfsdp_shim_grad_sqnorm", "mfsdp_shim_scale_grads", "mfsdp_shim_tag_pending",
             "mfsdp_shim_zero_grads", "mfsdp_shim_reload"]
    ns = types.SimpleNamespace(mfsdp_shim_abi_version=Fn(abi),
                               mfsdp_shim_last_error=Fn(err))
    for n in names:
        if n not in drop:
            setattr(ns, n, Fn(rc, log, n))
    return ns


def test_shim():
    raises(_shim.ShimError, ["the mfsdp shim is not preloaded", "mfsdp-run"], _shim.Shim,
           types.SimpleNamespace())
    ok("no mfsdp_shim_abi_version: the shim is not preloaded")
    saved = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = "/opt/x/libmfsdp_preload.so"
    try:
        raises(_shim.ShimError, ["/opt/x/libmfsdp_preload.so has no tagged mode"], _shim.Shim,
               types.SimpleNamespace())
    finally:
        if saved is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = saved
    ok("a preloaded shim without the tagged mode is named as such")
    raises(_shim.ShimError, ["ABI 7", "speaks 3"], _shim.Shim, lib(abi=7))
    ok("another ABI is refused")
    raises(_shim.ShimError, ["lacks mfsdp_shim_step"], _shim.Shim,
           lib(drop=("mfsdp_shim_step",)))
    ok("a missing function is refused")
    s = _shim.Shim(lib(rc=-4, err=b"groups[2].params[0].shape: expected ..."))
    raises(_shim.ShimError, ["mfsdp_shim_register failed (-4)", "groups[2].params[0].shape"],
           s.register, "{}")
    raises(_shim.ShimError, ["mfsdp_shim_tag failed (-4)"], s.tag, 0, 1, 0, [1], 1)
    ok("a negative status raises with the shim's message")
    log = []
    s = _shim.Shim(lib(rc=3, log=log))
    if s.register('{"format": 1}') != 3:
        raise SystemExit("FAIL: register does not return the handle")
    s.tag(3, _shim.TAG_REDUCE_SCATTER, 2, [1, 0, True], 3)
    s.tag(3, _shim.TAG_ALLGATHER, 1, None, 5)
    tags = [e for e in log if e[0] == "mfsdp_shim_tag"]
    if tags != [("mfsdp_shim_tag", 3, 1, 2, b"\x01\x00\x01", 3),
                ("mfsdp_shim_tag", 3, 0, 1, None, 5)]:
        raise SystemExit(f"FAIL: tag arguments {tags}")
    reg = [e for e in log if e[0] == "mfsdp_shim_register"]
    if reg != [("mfsdp_shim_register", b'{"format": 1}', 13)]:
        raise SystemExit(f"FAIL: register arguments {reg}")
    ok("register passes the JSON and its length; tag encodes has_grad as bytes, NULL for None")


def test_guard():
    if _guard.check_version("2.15.0+cu132") != (2, 15):
        raise SystemExit("FAIL: 2.15.0+cu132 not known")
    if _guard.check_version("2.11.0+cu130") != (2, 11):
        raise SystemExit("FAIL: 2.11.0+cu130 not known")
    raises(_guard.UnknownTorch, ["torch 2.14.1", "known: 2.11, 2.15"], _guard.check_version, "2.14.1")
    raises(_guard.UnknownTorch, ["torch 2.16.0a0"], _guard.check_version, "2.16.0a0")
    raises(_guard.UnknownTorch, ["cannot read"], _guard.check_version, "nightly")
    ok("torch versions: 2.11 and 2.15 known, others refused")

    def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream,
                           all_gather_stream, device, all_gather_comm):
        pass

    def foreach_reduce(fsdp_params, grads, group):  # renamed parameters: another FSDP2
        pass
    dist = types.SimpleNamespace(all_gather_single=print, reduce_scatter_single=print)
    coll = types.SimpleNamespace(dist=dist, foreach_all_gather=foreach_all_gather,
                                 foreach_reduce=foreach_reduce)
    pg = types.SimpleNamespace(foreach_all_gather=foreach_all_gather,
                               foreach_reduce=foreach_reduce)
    st = types.SimpleNamespace(FSDPState=types.SimpleNamespace(_lazy_init=print))
    t = types.SimpleNamespace(__version__="2.15.0")
    raises(_guard.UnknownTorch, ["foreach_reduce", "not the signature"], _guard.check_live,
           t, coll, pg, st)
    coll.dist = types.SimpleNamespace(all_gather_single=print)
    raises(_guard.UnknownTorch, ["reduce_scatter_single is missing"], _guard.check_live,
           t, coll, pg, st)
    ok("live FSDP2 with other signatures or entry points is refused")


def test_run():
    env = {"MFSDP_PRELOAD_LIB": "/x/libmfsdp_preload.so"}
    if run.candidates(env) != ["/x/libmfsdp_preload.so"]:
        raise SystemExit("FAIL: MFSDP_PRELOAD_LIB is not used alone")
    raises(run.RunError, ["MFSDP_PRELOAD_LIB=/x/libmfsdp_preload.so: no such file"],
           run.find_shim, env)
    cands = run.candidates({"MFSDP_BUILD_DIR": "bld"})
    repo = os.path.abspath(os.path.join(HERE, "..", ".."))
    if cands[-1] != os.path.join(repo, "bld", "ld_preload", run.LIB):
        raise SystemExit(f"FAIL: the repository build is not searched last: {cands}")
    if os.path.join(sys.prefix, "lib", run.LIB) not in cands:
        raise SystemExit("FAIL: the Python prefix's lib is not searched")
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "ld_preload"))
        open(os.path.join(d, "ld_preload", run.LIB), "w").close()
        found = run.find_shim({"MFSDP_BUILD_DIR": d})
        if found != os.path.join(d, "ld_preload", run.LIB):
            raise SystemExit(f"FAIL: find_shim found {found}")
    ok("shim search: MFSDP_PRELOAD_LIB, prefixes, the repository's build directory")
    e = run.companion_env({"PYTHONPATH": f"/a{os.pathsep}{run.BOOT}", "LD_PRELOAD": "/l/x.so"},
                          "tag", "/s/libmfsdp_preload.so")
    e2 = run.companion_env(e, "tag", "/s/libmfsdp_preload.so")
    if e2["PYTHONPATH"] != f"{run.BOOT}{os.pathsep}/a" or \
            e2["LD_PRELOAD"] != "/s/libmfsdp_preload.so /l/x.so" or e2["MFSDP_COMPANION"] != "tag":
        raise SystemExit(f"FAIL: companion_env {e2}")
    ok("mfsdp-run environment: path hook first once, shim first in LD_PRELOAD once")


def test_chain():
    with tempfile.TemporaryDirectory() as d:
        marker = os.path.join(d, "ran")
        with open(os.path.join(d, "sitecustomize.py"), "w") as f:
            f.write(f"open({marker!r}, 'w').write('yes')\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([run.BOOT, d, PYPKG]))
        env.pop("MFSDP_COMPANION", None)
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        if not os.path.exists(marker):
            raise SystemExit("FAIL: the path hook did not run the sitecustomize it shadows")
    ok("the path hook's sitecustomize runs the one it shadows")


def main():
    test_shim()
    test_guard()
    test_run()
    test_chain()
    print(f"units: {passed} ok")


if __name__ == "__main__":
    main()
