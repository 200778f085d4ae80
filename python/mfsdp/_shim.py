# SPDX-License-Identifier: Apache-2.0
"""ctypes binding of the shim's tagged-mode C API (include/mfsdp/shim.h).

The shim is LD_PRELOADed by ``mfsdp-run``, so its symbols sit in the process's global
namespace: ``ctypes.CDLL(None)`` finds them without knowing the library's path.
"""
import ctypes
import os

ABI_VERSION = 3  # MFSDP_SHIM_ABI_VERSION this companion speaks

TAG_ALLGATHER = 0
TAG_REDUCE_SCATTER = 1
TAG_REPLICATE = 2
TAG_SYNC = 3
TAG_SYNC_MOMENTUM = 4  # since ABI 3
TAG_LOAD_MOMENTUM = 5  # since ABI 3


class ShimError(RuntimeError):
    """A shim call failed, or the shim is absent or of another ABI."""


class Shim:
    """The loaded shim. Every method raises ShimError with the shim's own message."""

    def __init__(self, lib=None):
        lib = lib if lib is not None else ctypes.CDLL(None)
        try:
            abi = lib.mfsdp_shim_abi_version
        except AttributeError:
            preloaded = [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
                         if "libmfsdp_preload" in p]
            if preloaded:
                raise ShimError(
                    f"the preloaded mfsdp shim {preloaded[0]} has no tagged mode (no symbol "
                    "mfsdp_shim_abi_version): rebuild it from a version with "
                    "include/mfsdp/shim.h") from None
            raise ShimError(
                "the mfsdp shim is not preloaded: no symbol mfsdp_shim_abi_version in this "
                "process (start the job with mfsdp-run, which sets LD_PRELOAD to "
                "libmfsdp_preload.so)") from None
        abi.restype = ctypes.c_int
        abi.argtypes = []
        found = abi()
        if found != ABI_VERSION:
            raise ShimError(f"the preloaded mfsdp shim speaks tagged-mode ABI {found}, this "
                            f"companion speaks {ABI_VERSION}: install matching versions")
        missing = []

        def fn(name, restype, argtypes):
            try:
                f = getattr(lib, name)
            except AttributeError:
                missing.append(name)
                return None
            f.restype = restype
            f.argtypes = argtypes
            return f

        c_int, c_size, c_double = ctypes.c_int, ctypes.c_size_t, ctypes.c_double
        self._register = fn("mfsdp_shim_register", c_int, [ctypes.c_char_p, c_size])
        self._tag = fn("mfsdp_shim_tag", c_int,
                       [c_int, c_int, c_size, ctypes.c_char_p, c_size])
        self._untag = fn("mfsdp_shim_untag", c_int, [])
        self._pending = fn("mfsdp_shim_tag_pending", c_int, [])
        self._step = fn("mfsdp_shim_step", c_int, [c_int, c_double])
        self._sqnorm = fn("mfsdp_shim_grad_sqnorm", c_int, [c_int, ctypes.POINTER(c_double)])
        self._scale = fn("mfsdp_shim_scale_grads", c_int, [c_int, c_double])
        self._zero = fn("mfsdp_shim_zero_grads", c_int, [c_int])
        self._reload = fn("mfsdp_shim_reload", c_int, [c_int])
        self._last_error = fn("mfsdp_shim_last_error", ctypes.c_char_p, [])
        if missing:
            raise ShimError("the preloaded mfsdp shim lacks " + ", ".join(missing) +
                            f" although it reports ABI {found}")

    def _check(self, rc, what):
        if rc < 0:
            msg = self._last_error() or b""
            raise ShimError(f"{what} failed ({rc}): {msg.decode(errors='replace')}")
        return rc

    def register(self, manifest_json):
        data = manifest_json.encode()
        return self._check(self._register(data, len(data)), "mfsdp_shim_register")

    def tag(self, handle, kind, group, has_grad, nparams):
        flags = None if has_grad is None else bytes(1 if g else 0 for g in has_grad)
        self._check(self._tag(handle, kind, group, flags, nparams), "mfsdp_shim_tag")

    def untag(self):
        self._check(self._untag(), "mfsdp_shim_untag")

    def tag_pending(self):
        """True when this thread's tag was not consumed by a collective."""
        return self._check(self._pending(), "mfsdp_shim_tag_pending") == 1

    def step(self, handle, lr_factor):
        self._check(self._step(handle, float(lr_factor)), "mfsdp_shim_step")

    def grad_sqnorm(self, handle):
        out = ctypes.c_double(0.0)
        self._check(self._sqnorm(handle, ctypes.byref(out)), "mfsdp_shim_grad_sqnorm")
        return out.value

    def scale_grads(self, handle, coef):
        self._check(self._scale(handle, float(coef)), "mfsdp_shim_scale_grads")

    def zero_grads(self, handle):
        self._check(self._zero(handle), "mfsdp_shim_zero_grads")

    def reload(self, handle):
        self._check(self._reload(handle), "mfsdp_shim_reload")


def load():
    """The preloaded shim, or ShimError saying why not."""
    return Shim()
