"""A one-shot all-reduce of small tensors over peer memory, for tensor parallelism on one host.

A decode step all-reduces one row per sequence after every row-parallel layer (8 KiB for one
sequence at hidden size 4096), and at that size NCCL's collective costs 15-20 us, mostly latency.
Here each rank copies its tensor into a buffer that every rank of the TP group maps (torch's
symmetric memory: one static buffer per process), and one kernel
(``torch.ops.symm_mem.one_shot_all_reduce_out``) reads the peers' buffers and writes the sum into
the tensor. The kernel synchronises the ranks through signal pads in the same memory, without the
host, so it is captured in CUDA graphs like any kernel (the buffer never moves).

Which tensors take it: CUDA tensors on this rank's device, contiguous, 16-byte aligned, of
bfloat16 or float32 (float16 too where the kernel supports it, found by a test at set-up), of at
most :data:`MAX_BYTES` bytes in a multiple of 16; everything else goes to NCCL. The choice depends
only on the tensor's shape, dtype and layout, which are the same on every TP rank, so every rank
takes the same path in the same order. The kernel adds the ranks' values in rank order on every
rank: every rank gets the same bits (and with two ranks, the bits NCCL gives).

Set-up (:func:`create_custom_all_reduce`) is collective over the TP group: after each local step
(allocating the buffer, mapping the peers' buffers, a test reduction of known values) the ranks
compare notes over the group's own backend, and if any rank failed, or the ranks are on different
hosts, every rank logs one warning and keeps NCCL. ``PLINTH_CUSTOM_ALL_REDUCE=0`` turns it off.

bfloat16 rows (the decode steps' all-reduces) take plinth's own kernel (:class:`PeerKernel`,
``plinth/kernels/csrc/tp_all_reduce.cu``) where it builds and passes its test on every rank: it stages the
rows itself (one launch, not a copy and a reduction) and can also add the residual and apply the RMSNorm
that follows (:meth:`CustomAllReduce.all_reduce_add_rms_norm`). On two H200s one all-reduce of a
``[1, 4096]`` row costs 5.0 us there, 7.5 us through torch's one-shot kernel and 20.3 us through NCCL
(``benchmarks/tp_allreduce_gpu.py``).
NVLink multicast is never used: set-up sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in the worker
process, so mapping the buffers creates no multicast object. Ranks that share one device index
(Ray actors that each see one GPU) fail the mapping on every rank alike and keep NCCL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist

from plinth.config import env_flag
from plinth.kernels import nvrtc

logger = logging.getLogger(__name__)

CUSTOM_ALL_REDUCE_ENV = "PLINTH_CUSTOM_ALL_REDUCE"
#: the largest tensor it reduces: a decode batch of 128 rows of a 4096-wide bfloat16 hidden state
MAX_BYTES = 1 << 20
#: tensor sizes and addresses must be multiples of this (the kernel's widest vector access)
ALIGN_BYTES = 16
#: dtypes that must pass the set-up test (the kernel's), and one that is used where it passes
REQUIRED_DTYPES = (torch.bfloat16, torch.float32)
OPTIONAL_DTYPES = (torch.float16,)
#: how long the set-up test waits for a peer (a peer that failed before launching it fails this rank too)
SELF_TEST_WAIT_NS = 10_000_000_000
#: the sizes of the set-up test reductions (one decode row, and the largest)
_TEST_BYTES = (4096, MAX_BYTES)


class SymmetricMemoryOps:
    """The peer-memory calls the all-reduce makes, through ``torch.distributed._symmetric_memory``.

    Raises:
        ImportError, AttributeError, RuntimeError: this torch build has no symmetric memory or no
            one-shot all-reduce op.
    """

    def __init__(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_out.default

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """An uninitialised ``[nbytes]`` uint8 buffer that can be mapped by peers."""
        return self._symm_mem.empty(nbytes, dtype=torch.uint8, device=device)

    def rendezvous(self, buffer: torch.Tensor, group_name: str) -> Any:
        """Map every rank's buffer into this process (collective over the group); returns the handle."""
        # the one-shot kernel reads peers' memory directly: never create NVLink multicast objects
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        enable = getattr(self._symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:   # needed by older torch; newer versions only warn that it is not
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group_name)
        return self._symm_mem.rendezvous(buffer, group_name)

    def one_shot_all_reduce_out(self, staged: torch.Tensor, group_name: str, out: torch.Tensor) -> None:
        """``out = sum over ranks of staged`` (``staged`` a view at the start of the mapped buffer)."""
        self._one_shot(staged, "sum", group_name, out)


class PeerKernel:
    """The all-reduce kernel of ``plinth/kernels/csrc/tp_all_reduce.cu`` over a buffer that every rank of
    the group maps: one launch per all-reduce of bfloat16 rows, which stages this rank's rows itself and
    can finish with the residual add and RMSNorm that follow the reduction in a decoder layer.

    Build it on every rank of the group at once (allocation and mapping are collective).

    Args:
        group: the TP process group.
        device: this rank's CUDA device.
        max_bytes: the largest tensor it reduces.
        blocks: blocks per launch (at most ``MAX_BLOCKS``; each takes every ``blocks``-th row).
        wait_s: how long a launch waits for a peer before it fails with a CUDA error (trap); default the
            workers' step timeout (``PLINTH_WORKER_STEP_TIMEOUT_S``, 600 s).

    Raises:
        RuntimeError, ImportError, AttributeError: NVRTC, the driver or symmetric memory failed here.
    """

    #: blocks per launch by default: fixed per buffer (the per-block call counters must agree across calls)
    BLOCKS = 16
    #: the most blocks the flags region has room for (``FLAG_BYTES / (4 * MAX_RANKS)``)
    MAX_BLOCKS = 128
    #: bytes of flags at the start of each rank's buffer (``FLAG_BYTES`` in the source)
    FLAG_BYTES = 4096
    #: the widest row a block takes (eight values per thread, 1024 threads)
    MAX_COLS = 8192

    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES, blocks: int = BLOCKS,
                 wait_s: float | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        from plinth.distributed.executor import STEP_TIMEOUT_ENV, env_seconds

        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.world_size > 8:
            raise RuntimeError("the peer all-reduce kernel takes at most 8 ranks")
        if not 1 <= blocks <= self.MAX_BLOCKS:
            raise ValueError(f"blocks must be 1-{self.MAX_BLOCKS}, got {blocks}")
        self.blocks = blocks
        self.wait_ns = int(1e9 * (wait_s if wait_s is not None else env_seconds(STEP_TIMEOUT_ENV, 600.0)))
        self.max_bytes = max_bytes
        source = (nvrtc.CSRC / "tp_all_reduce.cu").read_text()
        self._plain = nvrtc.compile_function(source, "tp_all_reduce<false>", device.index)
        self._fused = nvrtc.compile_function(source, "tp_all_reduce<true>", device.index)
        total = self.FLAG_BYTES + 2 * max_bytes
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        buffer[: self.FLAG_BYTES].zero_()
        torch.cuda.synchronize(device)   # the flags are zero before any peer can write them
        self._buffer: torch.Tensor | None = buffer
        self._group_name = group.group_name
        self._handle: Any = None
        self._ptrs: torch.Tensor | None = None
        self._calls = torch.zeros(blocks, dtype=torch.int32, device=device)    # [blocks]

    def connect(self) -> None:
        """Map the peers' buffers (collective over the group)."""
        assert self._buffer is not None
        handle = SymmetricMemoryOps().rendezvous(self._buffer, self._group_name)
        total = self._buffer.numel()
        ptrs = [handle.get_buffer(r, (total,), torch.uint8).data_ptr() for r in range(self.world_size)]
        self._ptrs = torch.tensor(ptrs, dtype=torch.int64, device=self.device)     # [world]
        self._handle = handle

    def can_reduce(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (rows of its last dimension) takes the kernel; the same answer on every rank."""
        cols = x.shape[-1] if x.dim() else 0
        return (self._handle is not None and x.dtype == torch.bfloat16 and x.device == self.device
                and x.dim() >= 1 and cols % 8 == 0 and 0 < cols <= self.MAX_COLS and x.is_contiguous()
                and 0 < x.numel() * 2 <= self.max_bytes and x.data_ptr() % ALIGN_BYTES == 0)

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce_add_rms_norm` takes these tensors."""
        return (self.can_reduce(x) and residual.shape == x.shape and residual.dtype == x.dtype
                and residual.is_contiguous() and residual.device == x.device and residual.data_ptr() % ALIGN_BYTES == 0
                and weight.shape == x.shape[-1:] and weight.dtype == x.dtype and weight.is_contiguous()
                and weight.device == x.device and weight.data_ptr() % ALIGN_BYTES == 0)

    def all_reduce(self, x: torch.Tensor, wait_ns: int | None = None) -> None:
        """Sum ``x`` over the group, in place (``can_reduce(x)`` must hold)."""
        self._launch(self._plain, x, x, None, None, 0.0, wait_ns)

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> torch.Tensor:
        """``RMSNorm(sum(x) + residual) * weight``; ``residual`` becomes ``sum(x) + residual`` in place.

        ``x`` and ``residual`` ``[T, H]`` bfloat16, ``weight`` ``[H]`` bfloat16 (``can_reduce(x)`` must hold,
        and ``residual``/``weight`` contiguous and 16-byte aligned)."""
        out = torch.empty_like(x)
        self._launch(self._fused, x, out, residual, weight, eps)
        return out

    def _launch(self, func: int, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
                weight: torch.Tensor | None, eps: float, wait_ns: int | None = None) -> None:
        cols = x.shape[-1]
        rows = x.numel() // cols
        units = cols // 8
        threads = max(32, -(-units // 32) * 32)
        null = ctypes.c_void_p(0)
        assert self._ptrs is not None, "connect() first"
        args = [ctypes.c_void_p(self._ptrs.data_ptr()), ctypes.c_void_p(self._calls.data_ptr()),
                ctypes.c_int(self.rank), ctypes.c_int(self.world_size), ctypes.c_void_p(x.data_ptr()),
                ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(residual.data_ptr()) if residual is not None else null,
                ctypes.c_void_p(weight.data_ptr()) if weight is not None else null, ctypes.c_int(rows),
                ctypes.c_int(units), ctypes.c_float(eps), ctypes.c_uint64(self.max_bytes),
                ctypes.c_uint64(self.wait_ns if wait_ns is None else wait_ns)]
        nvrtc.launch(func, self.blocks, threads, 0, self.device, args, "the peer all-reduce kernel")

    def self_test(self) -> bool:
        """Reduce known values (one row, and the largest tensor) and check the sums; True if all exact."""
        ok = True
        for rows in (1, self.max_bytes // (2 * 4096)):
            base = (torch.arange(rows * 4096, device=self.device) % 8).view(rows, 4096).to(torch.bfloat16)
            x = base + self.rank
            self.all_reduce(x, wait_ns=SELF_TEST_WAIT_NS)
            w = self.world_size
            ok &= bool(torch.equal(x, base * w + w * (w - 1) // 2))
        return ok

    def close(self) -> None:
        """Drop the buffer and the peer mappings."""
        self._handle = None
        self._buffer = None


class CustomAllReduce:
    """The all-reduce of one TP group on one device. Build it with :func:`create_custom_all_reduce`.

    Args:
        group: the TP process group.
        device: this rank's device.
        ops: the peer-memory calls (:class:`SymmetricMemoryOps`).
        max_bytes: the size of the static buffer, and of the largest tensor reduced here.
    """

    def __init__(self, group: Any, device: torch.device, ops: Any, max_bytes: int = MAX_BYTES):
        self.group = group
        self.group_name = group.group_name
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.max_bytes = max_bytes
        self.dtypes: frozenset[torch.dtype] = frozenset(REQUIRED_DTYPES)
        self._ops = ops
        self._buffer: torch.Tensor | None = ops.empty(max_bytes, device)   # [max_bytes] uint8
        self._handle: Any = None
        #: the peer all-reduce kernel, for bfloat16 rows (set up after the one-shot path passed its test)
        self.peer: PeerKernel | None = None

    def connect(self) -> None:
        """Map the peers' buffers (collective over the group)."""
        assert self._buffer is not None
        self._handle = self._ops.rendezvous(self._buffer, self.group_name)

    def can_reduce(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the one-shot kernel (else NCCL); the same answer on every rank."""
        nbytes = x.numel() * x.element_size()
        return (self._handle is not None and x.device == self.device and x.dtype in self.dtypes
                and 0 < nbytes <= self.max_bytes and nbytes % ALIGN_BYTES == 0 and x.is_contiguous()
                and x.data_ptr() % ALIGN_BYTES == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.peer is not None and self.peer.can_reduce(x):
            self.peer.all_reduce(x)
        elif self.can_reduce(x):
            self._reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(RMSNorm(sum(x) + residual) * weight, sum(x) + residual)`` in one launch of the peer kernel
        (``residual`` is updated in place and returned); ``None`` where the kernel does not take these
        tensors (the caller reduces and norms separately). The same answer on every rank."""
        peer = self.peer
        if peer is None or not peer.can_fuse(x, residual, weight):
            return None
        return peer.all_reduce_add_rms_norm(x, residual, weight, eps), residual

    def _reduce(self, x: torch.Tensor) -> None:
        assert self._buffer is not None
        nbytes = x.numel() * x.element_size()
        staged = self._buffer[:nbytes].view(x.dtype).view(x.shape)   # x's shape, at the buffer's start
        staged.copy_(x)
        self._ops.one_shot_all_reduce_out(staged, self.group_name, x)

    def self_test(self) -> dict[torch.dtype, bool]:
        """Reduce known values of each dtype at a small and the largest size; which dtypes came out exact.

        Raises:
            RuntimeError: a required dtype failed in the op, or gave a wrong sum.
        """
        passed: dict[torch.dtype, bool] = {}
        for dtype in REQUIRED_DTYPES + OPTIONAL_DTYPES:
            try:   # every size runs on every rank, whatever the sums (the peers wait for each reduction)
                passed[dtype] = all([self._test_sum(dtype, nbytes) for nbytes in _TEST_BYTES if nbytes <= self.max_bytes])
            except RuntimeError:
                if dtype in REQUIRED_DTYPES:
                    raise
                passed[dtype] = False   # the op refused it (on every rank alike: the check is on the host)
        wrong = [str(d) for d in REQUIRED_DTYPES if not passed[d]]
        if wrong:
            raise RuntimeError(f"wrong sums for {', '.join(wrong)}")
        return passed

    def _test_sum(self, dtype: torch.dtype, nbytes: int) -> bool:
        n = nbytes // torch.empty((), dtype=dtype).element_size()
        base = (torch.arange(n, device=self.device) % 8).to(dtype)     # [n] small integers: exact in any dtype
        x = base + self.rank
        self._reduce(x)
        w = self.world_size
        return bool(torch.equal(x, base * w + w * (w - 1) // 2))

    def close(self) -> None:
        """Drop the buffers and the peer mappings (when the process group goes)."""
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self._handle = None
        self._buffer = None


def _host_id() -> int:
    return zlib.crc32(socket.gethostname().encode())


def _gather_flags(group: Any, device: torch.device, flags: list[int]) -> torch.Tensor:
    """Every rank's ``flags``: ``[world, len(flags)]`` int64 on the host (collective)."""
    mine = torch.tensor(flags, dtype=torch.int64, device=device)          # [F]
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts).cpu()                                       # [world, F]


def _failed_ranks(table: torch.Tensor) -> list[int]:
    return [r for r in range(table.shape[0]) if not int(table[r, 0])]


def create_custom_all_reduce(group: Any, device: torch.device, ops: Any = None) -> CustomAllReduce | None:
    """Set up the custom all-reduce of ``group`` (collective: every rank of the group calls it at once).

    Args:
        group: the TP process group (``None``: one rank, nothing to reduce).
        device: this rank's device; only CUDA devices take part unless ``ops`` is given.
        ops: the peer-memory calls (default :class:`SymmetricMemoryOps`).

    Returns:
        the all-reduce on every rank, or ``None`` on every rank: turned off, not a CUDA device, or
        a failure on some rank (each rank logs one warning saying why).

    Raises:
        ConfigError: ``PLINTH_CUSTOM_ALL_REDUCE`` is not a switch value (1/0, true/false, ...).
    """
    if group is None or (ops is None and device.type != "cuda"):
        return None
    if not env_flag(CUSTOM_ALL_REDUCE_ENV, True):
        logger.info("custom all-reduce off (%s=0)", CUSTOM_ALL_REDUCE_ENV)
        return None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    comm: CustomAllReduce | None = None
    passed: dict[torch.dtype, bool] = {}
    problem: str | None = None   # this rank's failure, or which ranks failed; after each step the same on all

    def step(what: str, fn: Any, extra: Any = list) -> torch.Tensor:
        """Run ``fn`` here, then gather every rank's outcome (and ``extra()`` flags): ``[world, 1 + E]``."""
        nonlocal problem
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - any failure of the peer-memory set-up means: use NCCL
            problem = f"{what} failed on this rank ({type(exc).__name__}: {exc})"
        table = _gather_flags(group, device, [problem is None, *extra()])
        if problem is None and _failed_ranks(table):
            problem = f"{what} failed on rank(s) {_failed_ranks(table)}"
        return table

    def build() -> None:
        nonlocal comm
        comm = CustomAllReduce(group, device, ops if ops is not None else SymmetricMemoryOps())

    table = step("allocating the peer-memory buffer", build, lambda: [_host_id()])
    if problem is None and len(set(table[:, 1].tolist())) > 1:
        problem = "the ranks of the tensor-parallel group are on different hosts"
    if problem is None:
        assert comm is not None
        step("mapping the peers' buffers", comm.connect)
    if problem is None:
        assert comm is not None
        table = step("the test reduction", lambda: passed.update(comm.self_test()),
                     lambda: [int(passed.get(d, False)) for d in OPTIONAL_DTYPES])
    if problem is None:
        assert comm is not None
        extra = {d for i, d in enumerate(OPTIONAL_DTYPES) if bool(table[:, 1 + i].all())}
        comm.dtypes = frozenset(REQUIRED_DTYPES) | extra
        if ops is None:
            comm.peer = _create_peer_kernel(group, device)
        logger.info("custom all-reduce on: tensors of up to %d KiB (%s) over peer memory, %d ranks%s",
                    comm.max_bytes >> 10, ", ".join(sorted(str(d).removeprefix("torch.") for d in comm.dtypes)),
                    comm.world_size, "; bfloat16 rows through plinth's kernel" if comm.peer is not None else "")
        return comm
    if comm is not None:
        comm.close()
    logger.warning("custom all-reduce not used, tensor-parallel all-reduces use %s: %s", dist.get_backend(group),
                   problem)
    return None


def _create_peer_kernel(group: Any, device: torch.device) -> PeerKernel | None:
    """Build, connect and test :class:`PeerKernel` on every rank (collective; the ranks compare notes after
    each step, so a failure on one rank never leaves another waiting in a collective step); ``None`` on every
    rank if any failed (each logs one warning; the one-shot path and NCCL stay)."""
    peer: PeerKernel | None = None
    problem: str | None = None

    def step(what: str, fn: Any) -> None:
        nonlocal problem
        if problem is None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - any failure of NVRTC, the driver or the mapping
                problem = f"{what} failed on this rank ({type(exc).__name__}: {str(exc)[:300]})"
        table = _gather_flags(group, device, [problem is None])
        if problem is None and _failed_ranks(table):
            problem = f"{what} failed on rank(s) {_failed_ranks(table)}"

    def build() -> None:
        nonlocal peer
        peer = PeerKernel(group, device)

    def test() -> None:
        assert peer is not None
        if not peer.self_test():
            raise RuntimeError("wrong sums")

    step("building it", build)
    step("mapping the peers' buffers", lambda: peer.connect())   # type: ignore[union-attr]
    step("its test reduction", test)
    if problem is None:
        return peer
    if peer is not None:
        peer.close()
    logger.warning("plinth's peer all-reduce kernel not used (torch's one-shot kernel and %s stay): %s",
                   dist.get_backend(group), problem)
    return None
