"""Run a function on a few local processes joined in a process group: the tutorials', tests' and
benchmarks' way to try ``torch.distributed`` (FSDP2, tensor parallelism, DCP) on one machine.

    results = run_local(worker, 2, folder)   # worker(rank, world, folder) on ranks 0 and 1

Each process is spawned (a fresh interpreter), joins a ``gloo`` group (or ``backend``) on
127.0.0.1 at a free port, runs ``fn(rank, world, *args)``, leaves the group and hands back its
return value (pickled through a private temporary folder). A rank that raises makes
:func:`run_local` raise a RuntimeError carrying that rank's traceback. ``fn`` must be importable
by the children (defined at module level in a module or a script guarded by ``__main__``).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_local", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, backend: str, port: int, out: str, threads: int | None, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    path = Path(out, f"rank{rank}.pkl")
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        path.write_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        path.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise SystemExit(1) from None
    # The result is on disk: leave without the interpreter's teardown. Once, under a loaded CI
    # run, both ranks of a finished FSDP2 job aborted in C++ static destructors ("terminate called
    # without an active exception", after destroy_process_group); their results were complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", threads: int | None = None) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each on its own process in one
    process group (``threads``: each process's ``torch.set_num_threads``, default torch's)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected a positive number of processes, got {world!r}")
    with tempfile.TemporaryDirectory(prefix="torchq-run-") as out:
        failure: ProcessException | None = None
        try:
            mp.start_processes(_entry, args=(fn, world, backend, free_port(), out, threads, args), nprocs=world,
                               join=True, start_method="spawn")
        except ProcessException as e:
            failure = e
        results = []
        for rank in range(world):
            path = Path(out, f"rank{rank}.pkl")
            status, value = pickle.loads(path.read_bytes()) if path.exists() else ("error", f"no result ({failure})")
            if status != "ok":
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            results.append(value)
    if failure is not None:
        raise RuntimeError(f"a process failed: {failure}")
    return results
