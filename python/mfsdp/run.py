# SPDX-License-Identifier: Apache-2.0
"""mfsdp-run CMD [ARGS...]: run an unmodified FSDP2 job with mfsdp.

Sets LD_PRELOAD to the shim (libmfsdp_preload.so) and puts the companion's path hook first
on PYTHONPATH, so that every Python process the command starts (torchrun's workers included)
loads the companion when it imports torch.distributed.fsdp; then execs CMD. Refuses, before
starting anything, when the shim cannot be found or the installed torch's FSDP2 is not a
version the companion knows.
"""
import os
import sys
import sysconfig

from . import _guard

LIB = "libmfsdp_preload.so"
BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")


class RunError(RuntimeError):
    pass


def _repo_root():
    """The repository this package is used from (editable install or PYTHONPATH), if any."""
    pkg = os.path.dirname(os.path.abspath(__file__))  # <repo>/python/mfsdp
    repo = os.path.dirname(os.path.dirname(pkg))
    try:
        with open(os.path.join(repo, "meson.build")) as f:
            if "project('mfsdp'" in f.read(4096):
                return repo
    except OSError:
        pass
    return None


def candidates(env=os.environ):
    """Where the shim is looked for, in order (MFSDP_PRELOAD_LIB alone when set)."""
    if env.get("MFSDP_PRELOAD_LIB"):
        return [env["MFSDP_PRELOAD_LIB"]]
    out = []
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for prefix in dict.fromkeys([sys.prefix, "/usr/local", "/usr"]):
        for lib in ["lib", "lib64"] + ([os.path.join("lib", multiarch)] if multiarch else []):
            out.append(os.path.join(prefix, lib, LIB))
    repo = _repo_root()
    if repo is not None:
        build = env.get("MFSDP_BUILD_DIR", "build")
        out.append(os.path.join(repo, build, "ld_preload", LIB))
    return out


def find_shim(env=os.environ):
    tried = candidates(env)
    for path in tried:
        if os.path.isfile(path):
            return os.path.abspath(path)
    if env.get("MFSDP_PRELOAD_LIB"):
        raise RunError(f"MFSDP_PRELOAD_LIB={env['MFSDP_PRELOAD_LIB']}: no such file")
    raise RunError("cannot find the mfsdp shim " + LIB + "; looked in:\n  " +
                   "\n  ".join(tried) + "\nbuild it (meson setup build && ninja -C build), "
                   "install it, or set MFSDP_PRELOAD_LIB to its path")


def companion_env(env, mode="tag", shim=None):
    """The environment of the job: the path hook first on PYTHONPATH, and LD_PRELOAD."""
    out = dict(env)
    out["MFSDP_COMPANION"] = mode
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT]
    out["PYTHONPATH"] = os.pathsep.join([BOOT] + parts)
    if shim is not None:
        pre = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split() if p != shim]
        out["LD_PRELOAD"] = " ".join([shim] + pre)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        print("\nusage: mfsdp-run COMMAND [ARGS...]   e.g. mfsdp-run torchrun "
              "--nproc-per-node 8 train.py", file=sys.stderr)
        return 0 if argv else 2
    try:
        version, _ = _guard.check_installed()
        shim = find_shim()
    except (RunError, _guard.UnknownTorch) as e:
        print(f"mfsdp-run: {e}", file=sys.stderr)
        return 1
    env = companion_env(os.environ, "tag", shim)
    if os.environ.get("MFSDP_DEBUG", "").upper() in ("INFO", "TRACE"):
        print(f"mfsdp-run: torch {version}, LD_PRELOAD={shim}", file=sys.stderr)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"mfsdp-run: cannot run {argv[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
