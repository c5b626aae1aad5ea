"""Run a function on N ranks: CPU processes over gloo, or GPU processes over NCCL.

``launch(fn, world_size)`` spawns ``world_size`` processes, initialises a process group in each
and calls ``fn(rank, world_size, *args)``. It returns the list of per-rank return values
(which must pickle). The first rank that raises has its exception re-raised here, with the
rank's formatted traceback attached as the cause. A rank that dies without reporting, or ranks
that are still running when ``timeout`` expires, make the launcher stop every rank and raise
``RuntimeError``/``TimeoutError`` naming them: never a silent hang. Every rank passes a
barrier right after the group forms (no rank leaves while a peer is still connecting), a rank
exits when the launching process is gone, and a rank's ``sys.exit`` is reported as
``RankFailed`` rather than ending the launching program.

Ranks start from a fork server (where the platform has one; else spawn) that imported torch
(and, where kernels run in Triton's interpreter, triton and distmoe) once, when the process's
first launch started it: a rank starts in well under a second where a spawned one spends
about 3 s of CPU importing torch again. Each rank still gets the
launching process's environment as it is at that launch (``OMP_NUM_THREADS`` sets torch's
CPU threads, as at a torch import), except what torch's libraries read only while being
imported: for that, the environment of the first launch holds. ``fn`` and ``args`` travel by
pickle either way (``fn`` importable by name).
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.multiprocessing as mp

from .kernels.base.interpreter import interpreter_active
from .runtime.cpu_shm import PREFIX_ENV, SHM_DIR


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the ``__cause__`` of a re-raised exception."""

    def __init__(self, rank: int, tb: str) -> None:
        super().__init__(f"\n--- traceback of rank {rank} ---\n{tb}")
        self.rank = rank


class RankFailed(RuntimeError):
    """A rank raised an exception that could not be pickled back, or died without reporting."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _exit_with_launcher(launcher: int) -> None:
    """End this rank when the launching process ``launcher`` is gone (a rank orphaned by a
    killed launcher would otherwise wait in a collective for the group's 30-minute timeout).
    Watched by pid, not as this process's parent: a rank's parent is the fork server, which
    lives as long as any rank does."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if not _alive(launcher):
                os._exit(70)

    threading.Thread(target=watch, name="distmoe-launcher-watch", daemon=True).start()


def _worker(rank: int, world_size: int, device: str, backend: str, gpus: Sequence[int],
            store_path: str, prefix: str, launcher: int, environ: dict, fn: Callable,
            args: tuple, results: Any) -> None:
    # the launching process's environment as it is now (the fork server's is as it was when
    # the first launch started it)
    os.environ.clear()
    os.environ.update(environ)
    os.environ[PREFIX_ENV] = prefix
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # as a spawned rank's torch import would
        torch.set_num_threads(int(threads))
    import torch.distributed as dist

    _exit_with_launcher(launcher)
    try:
        if device == "cuda":
            torch.cuda.set_device(gpus[rank % len(gpus)])
        dist.init_process_group(
            backend=backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            **({"device_id": torch.device("cuda", torch.cuda.current_device())}
               if backend == "nccl" else {}),
        )
        # Every rank connected before any goes on: otherwise a rank whose fn returns at once
        # can destroy the group and exit while a peer is still in gloo's connectFullMesh,
        # which then fails ("Connection closed by peer").
        dist.barrier()
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensor data into bytes; torch.multiprocessing's queue would
        # share it through this process, which may have exited by the time it is read.
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
        except Exception:
            payload = None
        results.put(("error", rank, (payload, tb, f"{type(exc).__name__}: {exc}")))
        return
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _rank_context():
    """The multiprocessing context the ranks start from: a fork server that has imported
    torch once (a rank then starts in well under a second, where a spawned one imports torch
    again: about 3 s of CPU each), on platforms that have it; else spawn. Never a plain fork
    of the launching process, which may hold CUDA state and threads."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed"]
    if interpreter_active():
        # Ranks running kernels through Triton's interpreter also get triton and distmoe from
        # the server (their imports cost a rank 1-2 s of CPU). Only there: importing distmoe
        # without TRITON_INTERPRET set asks torch whether CUDA exists, which initialises the
        # driver, and a process forked after that cannot use CUDA.
        preload += ["triton", "distmoe"]
    # effective only before the server starts (the first launch in this process)
    ctx.set_forkserver_preload(preload)
    return ctx


def _silent_deaths(procs, results, values, failed: int) -> list[tuple[int, int]]:
    """After rank ``failed`` reported an error: the ranks that exited abnormally without
    reporting anything, as ``(rank, exit code)``. Reports still in the queue are read for up
    to a second first (a peer's error often arrives before its killer's exit is seen)."""
    reported = set(values) | {failed}
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            _, rank, _ = results.get(timeout=0.1)
            reported.add(rank)
        except queue.Empty:
            pass
        if all(r in reported or p.exitcode is not None for r, p in enumerate(procs)):
            break
    return [(r, p.exitcode) for r, p in enumerate(procs)
            if r not in reported and p.exitcode not in (None, 0)]


def _clean_shm(prefix: str) -> None:
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix + "-"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    device: Literal["cpu", "cuda"] = "cpu",
    args: tuple = (),
    timeout: float = 300.0,
    gpus: Sequence[int] | None = None,
    backend: Literal["auto", "gloo", "nccl"] = "auto",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return their results.

    Args:
        fn: a picklable (module-level) function.
        world_size: number of ranks (>= 1).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; rank r uses GPU ``gpus[r % len(gpus)]``,
            so several ranks may share one GPU).
        args: extra positional arguments passed to ``fn`` (must pickle).
        timeout: seconds for the whole run; on expiry every rank is stopped and
            ``TimeoutError`` names the ranks that had not finished.
        gpus: CUDA device indices to use (default: all visible).
        backend: process-group backend; ``"auto"`` = NCCL when every rank has a GPU of its
            own, gloo otherwise (NCCL refuses two ranks on one GPU; the CUDA IPC heap then
            carries the data and gloo only exchanges handles and host barriers).
    Returns:
        ``[result of rank 0, ..., result of rank world_size-1]``.
    Raises:
        The first failing rank's exception (with ``RemoteTraceback`` as cause); ``RankFailed``
        if it cannot be re-created or a rank died without reporting; ``TimeoutError``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size ({world_size!r}) must be a positive int")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device ({device!r}) must be 'cpu' or 'cuda'")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device ('cuda') needs CUDA, but torch.cuda.is_available() is False")
        gpus = list(range(torch.cuda.device_count())) if gpus is None else list(gpus)
        if not gpus:
            raise ValueError("gpus must name at least one CUDA device")
    else:
        gpus = []
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend ({backend!r}) must be 'auto', 'gloo' or 'nccl'")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and world_size <= len(gpus) else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError("backend ('nccl') needs device 'cuda'")
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout ({timeout!r}) must be a finite number of seconds > 0")

    ctx = _rank_context()
    results = ctx.Queue()
    prefix = f"distmoe-{uuid.uuid4().hex[:10]}"
    # The ranks meet through a file store, not a TCP port: a port picked as free here can be
    # taken by another process before rank 0 listens on it (EADDRINUSE). A new file per
    # launch; removed below.
    store_path = os.path.join(tempfile.gettempdir(), f"{prefix}-rendezvous")
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, device, backend, gpus, store_path, prefix,
                                          os.getpid(), dict(os.environ), fn, args, results),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failure: tuple[int, Any] | None = None
    finished = False  # every rank reported a result: they get time to exit on their own
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size and failure is None:
            try:
                kind, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in values and p.exitcode is not None]
                if dead:
                    # Let a report that raced the exit arrive before calling it a death.
                    try:
                        kind, rank, payload = results.get(timeout=1.0)
                    except queue.Empty:
                        r = dead[0]
                        raise RankFailed(
                            f"rank {r} of {world_size} died with exit code {procs[r].exitcode} "
                            "without reporting a result"
                        ) from None
                elif time.monotonic() > deadline:
                    pending = [r for r in range(world_size) if r not in values]
                    raise TimeoutError(
                        f"launch timed out after {timeout:.0f} s; ranks still running: {pending}"
                    ) from None
                else:
                    continue
            if kind == "ok":
                try:
                    values[rank] = pickle.loads(payload)
                except Exception as exc:
                    raise RankFailed(f"rank {rank} of {world_size} returned a value that does "
                                     f"not unpickle here: {type(exc).__name__}: {exc}") from exc
            else:
                failure = (rank, payload)
        if failure is not None:
            rank, (pickled, tb, summary) = failure
            cause = RemoteTraceback(rank, tb)
            dead = _silent_deaths(procs, results, values, rank)
            if dead:  # the failure above is most likely a peer noticing this death
                r, code = dead[0]
                raise RankFailed(
                    f"rank {r} of {world_size} died with exit code {code} without reporting a "
                    f"result; then rank {rank} failed: {summary}") from cause
            exc = None
            if pickled is not None:
                try:
                    exc = pickle.loads(pickled)
                except Exception:
                    exc = None
            if isinstance(exc, BaseException) and not isinstance(exc, SystemExit):
                raise exc from cause
            # a rank's SystemExit (sys.exit in fn) would end the launching program quietly
            raise RankFailed(f"rank {rank} of {world_size} failed: {summary}") from cause
        finished = True
        return [values[r] for r in range(world_size)]
    finally:
        # one shared grace period (one per rank would make a timeout late by 2 s per rank)
        grace_end = time.monotonic() + (2.0 if finished else 0.5)
        for p in procs:
            p.join(timeout=max(0.0, grace_end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        _clean_shm(prefix)
        try:
            os.unlink(store_path)
        except OSError:
            pass
