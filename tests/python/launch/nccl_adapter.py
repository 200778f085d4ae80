# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: FSDP2's collectives through the test NCCL library (tests/lib/nccl_mpi_fake.c).

FSDP2 on CPU talks gloo, which the shim never sees. This adapter replaces the `dist` that
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py calls with a proxy whose
all_gather_single / reduce_scatter_single / all_reduce run ncclAllGather /
ncclReduceScatter / ncclAllReduce of libnccl_mpi_fake.so on the tensors' host memory.

The library is loaded with RTLD_GLOBAL and every NCCL function is looked up in the global
namespace (ctypes.CDLL(None)), so an LD_PRELOADed libmfsdp_preload.so interposes exactly as
it does in front of libtorch_cuda's NCCL on a GPU. The library runs over MPI: this adapter
calls MPI_Init_thread (the job is started by mpirun) before its first communicator and
MPI_Finalize at exit. One NCCL communicator spans the world (unique id broadcast over gloo);
a torch sub-group (HSDP shard or replicate group) gets an ncclCommSplit of it, created when
every rank reaches its own sub-group's first collective (FSDP2's order is the same on every
rank). All calls complete before they return (async_op is honoured by returning None).
"""
import atexit
import ctypes

import torch
import torch.distributed as dist

NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
               torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
MPI_THREAD_MULTIPLE = 3  # Open MPI's value


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Adapter:
    def __init__(self, libpath):
        self.fake = ctypes.CDLL(libpath, mode=ctypes.RTLD_GLOBAL)
        self.g = ctypes.CDLL(None)  # global namespace: the preloaded shim comes first
        vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, args in [("ncclAllGather", [vp, vp, sz, ci, vp, vp]),
                           ("ncclReduceScatter", [vp, vp, sz, ci, ci, vp, vp]),
                           ("ncclAllReduce", [vp, vp, sz, ci, ci, vp, vp]),
                           ("ncclGetUniqueId", [ctypes.POINTER(UniqueId)]),
                           ("ncclCommInitRank", [ctypes.POINTER(vp), ci, UniqueId, ci]),
                           ("ncclCommSplit", [vp, ci, ci, ctypes.POINTER(vp), vp]),
                           ("ncclCommDestroy", [vp])]:
            f = getattr(self.g, name)
            f.argtypes = args
            f.restype = ci
        self.g.ncclGetLastError.restype = ctypes.c_char_p
        self.g.ncclGetLastError.argtypes = [vp]
        self.world = None
        self.comms = {}
        self.order = []
        self.own_mpi = False
        self.calls = 0

    def _check(self, rc, what):
        if rc != 0:
            msg = self.g.ncclGetLastError(None) or b""
            raise RuntimeError(f"nccl_adapter: {what} returned {rc}: {msg.decode()}")

    def _mpi_init(self):
        flag = ctypes.c_int(0)
        self.g.MPI_Initialized(ctypes.byref(flag))
        if not flag.value:
            provided = ctypes.c_int(0)
            rc = self.g.MPI_Init_thread(None, None, MPI_THREAD_MULTIPLE, ctypes.byref(provided))
            if rc != 0:
                raise RuntimeError(f"nccl_adapter: MPI_Init_thread returned {rc}")
            self.own_mpi = True
        atexit.register(self.close)

    def comm(self, group):
        group = group if group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        c = self.comms.get(ranks)
        if c is not None:
            return c
        if self.world is None:
            self._mpi_init()
            uid = UniqueId()
            if dist.get_rank() == 0:
                self._check(self.g.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            raw = ctypes.string_at(ctypes.addressof(uid), 128)
            buf = torch.tensor(list(raw), dtype=torch.uint8)
            dist.broadcast(buf, src=0)
            ctypes.memmove(ctypes.addressof(uid), bytes(buf.tolist()), 128)
            w = ctypes.c_void_p()
            self._check(self.g.ncclCommInitRank(ctypes.byref(w), dist.get_world_size(), uid,
                                                dist.get_rank()), "ncclCommInitRank")
            self.world = w
            self.comms[tuple(range(dist.get_world_size()))] = w
            self.order.append(w)
            c = self.comms.get(ranks)
            if c is not None:
                return c
        sub = ctypes.c_void_p()
        self._check(self.g.ncclCommSplit(self.world, min(ranks), ranks.index(dist.get_rank()),
                                         ctypes.byref(sub), None), "ncclCommSplit")
        self.comms[ranks] = sub
        self.order.append(sub)
        return sub

    def close(self):
        for c in reversed(self.order):
            self.g.ncclCommDestroy(c)
        self.order.clear()
        self.comms.clear()
        if self.own_mpi:
            fin = ctypes.c_int(0)
            self.g.MPI_Finalized(ctypes.byref(fin))
            if not fin.value:
                self.g.MPI_Finalize()
            self.own_mpi = False

    @staticmethod
    def _dtype(t):
        if t.dtype not in NCCL_DTYPES:
            raise RuntimeError(f"nccl_adapter: dtype {t.dtype} has no NCCL type")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise RuntimeError("nccl_adapter: needs contiguous CPU tensors")
        return NCCL_DTYPES[t.dtype]

    @staticmethod
    def _op(op):
        if op == dist.ReduceOp.SUM:
            return 0
        if op == dist.ReduceOp.AVG:
            return 4
        raise RuntimeError(f"nccl_adapter: reduce op {op} is not routed (sum and avg only)")

    def all_gather_single(self, output, input, group=None, async_op=False):
        comm = self.comm(group)
        n = dist.get_world_size(group)
        if output.numel() != input.numel() * n or output.dtype != input.dtype:
            raise RuntimeError("nccl_adapter: all_gather_single sizes/dtypes disagree")

        self._check(self.g.ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                                         self._dtype(input), comm, None), "ncclAllGather")
        self.calls += 1
        return None

    def reduce_scatter_single(self, output, input, group=None, op=dist.ReduceOp.SUM,
                              async_op=False):
        comm = self.comm(group)
        n = dist.get_world_size(group)
        if input.numel() != output.numel() * n or output.dtype != input.dtype:
            raise RuntimeError("nccl_adapter: reduce_scatter_single sizes/dtypes disagree")

        self._check(self.g.ncclReduceScatter(input.data_ptr(), output.data_ptr(),
                                             output.numel(), self._dtype(input),
                                             self._op(op), comm, None), "ncclReduceScatter")
        self.calls += 1
        return None

    # torch 2.11's FSDP2 calls the older entry points (with keywords): the same collectives.
    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return self.all_gather_single(output_tensor, input_tensor, group=group)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None,
                              async_op=False):
        return self.reduce_scatter_single(output, input, group=group, op=op)

    def _raw_all_reduce(self, tensor, op, comm):
        self._check(self.g.ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                         self._dtype(tensor), self._op(op), comm, None),
                    "ncclAllReduce")

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        comm = self.comm(group)

        self._raw_all_reduce(tensor, op, comm)
        self.calls += 1
        return None


class _Proxy:
    def __init__(self, inner, adapter):
        self.__dict__["_inner"] = inner
        self.__dict__["_adapter"] = adapter

    def __getattr__(self, name):
        if name in ("all_gather_single", "reduce_scatter_single", "all_reduce",
                    "all_gather_into_tensor", "reduce_scatter_tensor"):
            return getattr(self._adapter, name)
        return getattr(self._inner, name)


ADAPTER = None


def install(collectives, libpath):
    global ADAPTER
    ADAPTER = Adapter(libpath)
    collectives.dist = _Proxy(collectives.dist, ADAPTER)
    return ADAPTER
