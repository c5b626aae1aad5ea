"""One contiguous virtual range whose pieces live in different memory tiers (issue 62, item 2).

The activation buffer's planned layout (:attr:`distmoe.memory.MemoryPlan.regions`) puts the
slots and the hot scratch in device memory and the overflow scratch in pinned host pages, all
in one address range, so that the kernels see one buffer and a row index decides which tier
it reads. :class:`TieredRange` maps such a range through CUDA's virtual memory management
(driver API through cuda-python's ``cuda.bindings``: ``cuMemAddressReserve``, ``cuMemCreate``
with a device or a host location, ``cuMemMap``, ``cuMemSetAccess``), once, at creation;
pages stay in their tier until :meth:`TieredRange.close` unmaps and releases them. On a CPU
device every tier is ordinary memory (one ``torch.empty``), with the same layout and the
same per-tier byte counts, so the code that places rows is the same.

Each piece is rounded up to the allocation granularity (2 MiB on Hopper for both tiers; read
from the driver), so a piece's bytes in :attr:`TieredRange.tier_bytes` are the requested
bytes rounded up to it. The symmetric communication buffers stay separate device
allocations (peers map them; host-backed VMM pages are not IPC-capable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Piece", "TieredRange", "vmm_granularity"]

TIERS = ("device", "host")


@dataclass(frozen=True)
class Piece:
    """A mapped piece of a :class:`TieredRange`: byte offset from the range's start, bytes
    (a multiple of the granularity) and tier (``"device"`` or ``"host"``)."""

    offset: int
    num_bytes: int
    tier: str


def _driver():
    """cuda-python's driver module, or an ImportError naming the package."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("host-backed (VMM) memory needs cuda-python's driver bindings: "
                          "pip install cuda-bindings (or cuda-python)") from exc
    return driver


def _check(result, what: str):
    """``(err, *values)`` of a driver call: the values, or RuntimeError naming the call."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err}")
    return values[0] if len(values) == 1 else values


def _prop(tier: str, device_index: int):
    driver = _driver()
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    if tier == "device":
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
    else:
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        prop.location.id = 0  # ignored for HOST
    return prop


def vmm_granularity(device: torch.device, tiers: Sequence[str] = TIERS) -> int:
    """Bytes every piece is rounded up to on ``device``: the largest of ``tiers``' minimum
    granularities (1 on a CPU device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    driver = _driver()
    option = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(int(_check(driver.cuMemGetAllocationGranularity(_prop(t, index), option),
                          f"cuMemGetAllocationGranularity ({t} tier)")) for t in set(tiers))


class _CudaArray:
    """The range as ``__cuda_array_interface__`` for ``torch.as_tensor`` (no copy; the tensor
    keeps this object, and through it the range, alive)."""

    def __init__(self, address: int, num_bytes: int, owner: TieredRange) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3,
                                         "strides": None}


class TieredRange:
    """``pieces`` (``(num_bytes, tier)`` in address order) mapped into one virtual range on
    ``device``; :attr:`tensor` is the whole range as a uint8 tensor.

    Raises RuntimeError at creation where the driver cannot map a tier (for host pages: a
    driver without host-located VMM allocations), naming the tier and the driver's error;
    nothing stays mapped then. ``close()`` (idempotent; also on garbage collection) unmaps and
    releases every piece: the caller must have synchronised the work that uses it, and no
    view of :attr:`tensor` may be used after it (the tensor keeps the range object, not the
    mapping, alive: call ``close`` explicitly, as the heap's buffers are closed)."""

    def __init__(self, pieces: Sequence[tuple[int, str]], device: torch.device | str) -> None:
        self.device = torch.device(device)
        for i, (num_bytes, tier) in enumerate(pieces):
            if tier not in TIERS:
                raise ValueError(f"pieces[{i}] tier ({tier!r}) must be one of {TIERS}")
            if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
                raise ValueError(f"pieces[{i}] bytes ({num_bytes!r}) must be a positive int")
        # only the tiers in use: a device-only range needs no host-page support
        gran = vmm_granularity(self.device, [tier for _, tier in pieces])
        offset, laid = 0, []
        for num_bytes, tier in pieces:
            size = -(-num_bytes // gran) * gran
            laid.append(Piece(offset=offset, num_bytes=size, tier=tier))
            offset += size
        self.pieces: tuple[Piece, ...] = tuple(laid)
        self.num_bytes = offset
        self.granularity = gran
        self._handles: list = []
        self._address = 0
        self._closed = False
        if self.device.type != "cuda":
            self.tensor = torch.empty(offset, dtype=torch.uint8, device=self.device)
            return
        try:
            self._map()
        except BaseException:
            self.close()
            raise
        self.tensor = torch.as_tensor(_CudaArray(self._address, offset, self),
                                      device=self.device)

    def _map(self) -> None:
        driver = _driver()
        index = self.device.index if self.device.index is not None \
            else torch.cuda.current_device()
        torch.zeros(1, device=self.device)  # the device's primary context, current here
        _check(driver.cuInit(0), "cuInit")
        self._address = int(_check(driver.cuMemAddressReserve(self.num_bytes, self.granularity,
                                                              0, 0), "cuMemAddressReserve"))
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for piece in self.pieces:
            try:
                handle = _check(driver.cuMemCreate(piece.num_bytes, _prop(piece.tier, index), 0),
                                f"cuMemCreate ({piece.num_bytes} B, {piece.tier} tier)")
            except RuntimeError as exc:
                if piece.tier == "host":
                    raise RuntimeError(
                        f"{exc}: this driver cannot back virtual memory with pinned host "
                        "pages (CUDA 12.2 or newer with host-located VMM allocations); run "
                        "without total_scratch_factor") from exc
                raise
            self._handles.append((handle, piece, False))
            _check(driver.cuMemMap(self._address + piece.offset, piece.num_bytes, 0, handle, 0),
                   "cuMemMap")
            self._handles[-1] = (handle, piece, True)
        _check(driver.cuMemSetAccess(self._address, self.num_bytes, [access], 1),
               "cuMemSetAccess")

    @property
    def tier_bytes(self) -> dict[str, int]:
        """Mapped bytes per tier."""
        out = dict.fromkeys(TIERS, 0)
        for piece in self.pieces:
            out[piece.tier] += piece.num_bytes
        return out

    def location_of(self, offset: int) -> str:
        """The tier the driver reports for the byte at ``offset`` (GPU: the allocation's
        location read back through ``cuMemRetainAllocationHandle``; CPU: the planned one)."""
        piece = next((p for p in self.pieces if p.offset <= offset < p.offset + p.num_bytes),
                     None)
        if piece is None:
            raise ValueError(f"offset ({offset}) must lie in [0, {self.num_bytes})")
        if self.device.type != "cuda":
            return piece.tier
        driver = _driver()
        handle = _check(driver.cuMemRetainAllocationHandle(self._address + offset),
                        "cuMemRetainAllocationHandle")
        try:
            prop = _check(driver.cuMemGetAllocationPropertiesFromHandle(handle),
                          "cuMemGetAllocationPropertiesFromHandle")
        finally:
            driver.cuMemRelease(handle)
        kind = prop.location.type
        return "device" if kind == driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE \
            else "host"

    def close(self) -> None:
        """Unmap and release every piece and the address range (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.device.type != "cuda":
            return
        driver = _driver()
        for handle, piece, mapped in self._handles:
            if mapped:
                driver.cuMemUnmap(self._address + piece.offset, piece.num_bytes)
            driver.cuMemRelease(handle)
        self._handles = []
        if self._address:
            driver.cuMemAddressFree(self._address, self.num_bytes)
            self._address = 0
