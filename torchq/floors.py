"""The package's floors: each module imports only modules of its own floor or below.

A module's floor is that of the longest prefix below naming it. ``tests/test_layering.py`` reads every
import of every module (lazy ones included) and checks this, that no import circle exists and that
no module imports another's private (``_name``) function or class, with the exceptions listed here.
"""

from __future__ import annotations

__all__ = ["FLOORS", "ALLOWED_UPWARD", "ALLOWED_CIRCLES", "ALLOWED_PRIVATE", "floor_of"]

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("torchq._version", "torchq.serialization", "torchq.hooks", "torchq.floors", "torchq.tracing",
                    "torchq.identity_cache", "torchq.bitpack", "torchq.patterns", "torchq.timing", "torchq.prefill")),
    ("numerics", ("torchq.division", "torchq.primitives", "torchq.float8", "torchq.canonical", "torchq.activation", "torchq.algorithms",
                  "torchq.blockwise")),
    ("ops", ("torchq.ops",)),
    ("backends", ("torchq.backends", "torchq.native")),
    ("selection", ("torchq.dispatch", "torchq.layouts")),
    ("weight", ("torchq.tensor", "torchq.configs", "torchq.explain")),
    ("storage and parallelism", ("torchq.checkpoint", "torchq.distributed")),
    ("workflows", ("torchq.quantize", "torchq.calibrate", "torchq.autotune", "torchq.qat", "torchq.static",
                   "torchq.optim")),
    ("integrations and entry points", ("torchq.interop", "torchq.hf", "torchq.vllm", "torchq.cli", "torchq.demo",
                                       "torchq.bench_linear", "torchq.__main__", "torchq")),
)

# FSDP2 calls ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the tensor subclass itself: the
# tensor's methods import their implementation from the parallelism floor when FSDP2 calls them.
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset({("torchq.tensor", "torchq.distributed.fsdp")})
ALLOWED_CIRCLES: tuple[frozenset[str], ...] = (frozenset({"torchq.tensor", "torchq.distributed.fsdp"}),)
# Pickles name ``torchq._rebuild_quantized_tensor`` and ``torchq._rebuild_object``: the package
# re-exports them from :mod:`torchq.serialization` under those pinned names.
ALLOWED_PRIVATE: frozenset[tuple[str, str, str]] = frozenset({
    ("torchq", "torchq.serialization", "_rebuild_object"),
    ("torchq", "torchq.serialization", "_rebuild_quantized_tensor"),
})


def floor_of(module: str) -> int | None:
    """The index in :data:`FLOORS` of ``module`` (a dotted name), or None for no floor."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]
