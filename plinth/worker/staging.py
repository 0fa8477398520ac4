"""Host-to-device transfer of a step's index arrays (token ids, positions, slots, block tables, ...)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostStaging:
    """Sends a step's small integer arrays to the device.

    On the CPU the tensors are views of the arrays: no copy at all. On a CUDA device the arrays of
    each dtype are packed into one persistent pinned host buffer and sent with one non-blocking
    copy; an event recorded after the copies is waited on before the buffers are refilled, so a
    step never overwrites what an earlier copy has not read yet (normally long done: every step
    reads its sampled tokens back). Other devices get one ordinary copy per array.

    Args:
        device: where the tensors go.
        packed: force the packed path on or off (default: on for CUDA devices only); the host
            buffers are pinned only on CUDA.
    """

    def __init__(self, device: torch.device, packed: bool | None = None):
        self.device = torch.device(device)
        is_cuda = self.device.type == "cuda"
        self.packed = is_cuda if packed is None else packed
        self._pin = is_cuda
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._event: torch.cuda.Event | None = None

    def upload(self, int64: Sequence[np.ndarray], int32: Sequence[np.ndarray]) -> tuple[list[torch.Tensor],
                                                                                       list[torch.Tensor]]:
        """Device tensors of the same shapes as the arrays: ``int64`` ones as int64, ``int32`` ones as int32."""
        if not self.packed:
            return self._each(int64, torch.int64), self._each(int32, torch.int32)
        if self._event is not None:
            self._event.synchronize()
        out = self._pack(int64, torch.int64), self._pack(int32, torch.int32)
        if self._pin:
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def _each(self, arrays: Sequence[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        np_dtype = np.int64 if dtype == torch.int64 else np.int32
        out = []
        for a in arrays:
            a = np.ascontiguousarray(a, dtype=np_dtype)
            if not a.flags.writeable:   # (an array Ray's object store handed over read-only: torch warns on it)
                a = a.copy()
            t = torch.from_numpy(a)
            out.append(t if self.device.type == "cpu" else t.to(self.device, non_blocking=True))
        return out

    def _pack(self, arrays: Sequence[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        total = sum(a.size for a in arrays)
        host = self._host.get(dtype)
        if host is None or host.numel() < total:
            size = max(total, 2 * host.numel() if host is not None else 4096)
            host = torch.empty(size, dtype=dtype, pin_memory=self._pin)
            self._host[dtype] = host
        view = host.numpy()
        offset = 0
        for a in arrays:
            view[offset: offset + a.size] = a.reshape(-1)
            offset += a.size
        dev = host[:total].to(self.device, non_blocking=True, copy=True)     # one copy per dtype
        out = []
        offset = 0
        for a in arrays:
            out.append(dev[offset: offset + a.size].view(a.shape))
            offset += a.size
        return out
