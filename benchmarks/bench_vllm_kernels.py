"""One linear layer of SmolLM2's shapes, bf16 activations, in one process: torchq's int8 dynamic
kernel (``int8dq`` in the layout torchq's vLLM plugin serves it in: ``int8_vnni`` on VNNI CPUs; and in
the row-major ``plain`` layout) against vLLM's own W8A8 kernels on the CPU (the
compressed-tensors ``int-quantized`` scheme, symmetric per-token dynamic int8 activations) and
against bf16 ``F.linear``, for decode (1 row), batch (16) and prompt (64, 128, 256) sizes. vLLM has
two: ``int8_scaled_mm_with_quant`` on weights packed by ``convert_weight_packed`` (its "SGL" AMX
kernel, which its CPU W8A8 linear takes where ``check_cpu_sgl_kernel`` passes: AMX CPUs, K % 32 == 0
and N % 16 == 0, every SmolLM2 layer) and oneDNN (``onednn_scaled_int8_quant`` + ``onednn_scaled_mm``,
its fallback elsewhere); both are timed, and "vs vLLM" is against the one vLLM would run here.

Both int8 paths get the same int8 per-channel weights. The candidates alternate within each round
(this VM's speed drifts by 2x over minutes, so only interleaved timings compare) and each keeps its
best round. Run it in vLLM's environment (``bash .ci/vllm_env .venv-vllm``):

    .venv-vllm/bin/python benchmarks/bench_vllm_kernels.py --threads 2 --json kernels.json

``--configs`` adds a second table: torchq configs (``config_from_name`` names, each in the layout
the plugin's ``auto`` policy serves it in on this CPU, called as its ``apply`` calls them: through a
``torchq.dispatch.DirectLinear`` per layer; ``--call f.linear`` times ``F.linear`` instead) against the float kernel vLLM's own
linear runs on the bf16 weight (``dispatch_cpu_unquantized_gemm``: its packed SGL kernel on AMX
CPUs, else oneDNN on a prepacked weight), which is what ``× float`` in ``bench_vllm.py`` compares
against, and ``F.linear``. A layer called again and again keeps its weight in the CPU's caches;
a served model reads every layer's weight from memory once per step: ``--stream-mb N`` gives each
candidate copies of its weight, at least N MB of bf16 weights' worth, and each call takes the
next (N above the last-level cache); each timing then runs through every copy at least once.

    .venv-vllm/bin/python benchmarks/bench_vllm_kernels.py --threads 1 --rows 1,16,256 \
        --configs int4-g32,int4-g32-fp32,nf4,int8wo,int8dq,int4a8 --stream-mb 256
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import torchq
from torchq.activation import PerTokenInt8, StaticInt8
from torchq.configs import config_from_name
from torchq.dispatch import DirectLinear
from torchq.layouts.int8_vnni import Int8VnniLayout
from torchq.layouts.plain import PlainLayout

#: (out_features, in_features) of SmolLM2-135M's linears: gate+up fused, down, qkv fused, o
SHAPES = ((3072, 576), (576, 1536), (960, 576), (576, 576))


def _timed(fn, reps: int) -> float:
    """Microseconds per call of ``reps`` calls after one warm-up call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def _vllm_onednn(codes: torch.Tensor, scales: torch.Tensor):
    """vLLM's oneDNN W8A8 path on these int8 weights ([N, K] codes, [N] fp32 scales), as a function
    of the activations (its ``_apply_weights_onednn``)."""
    import vllm._custom_ops as ops

    handler = ops.create_onednn_scaled_mm(codes.t(), scales, torch.bfloat16, True, False)

    def run(x: torch.Tensor) -> torch.Tensor:
        xq, xs, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty((x.shape[0], codes.shape[0]), dtype=torch.bfloat16)
        ops.onednn_scaled_mm(handler, xq, out, xs, None, None, None)
        return out

    return run


def _vllm_sgl(codes: torch.Tensor, scales: torch.Tensor):
    """vLLM's SGL W8A8 kernel (its ``_apply_weights_sgl``) on these weights, or None where vLLM
    would not take it."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    n, k = codes.shape
    if not check_cpu_sgl_kernel(n, k, torch.int8):
        return None
    packed = torch.ops._C.convert_weight_packed(codes)
    w_scale = scales.reshape(n, 1)
    return lambda x: torch.ops._C.int8_scaled_mm_with_quant(x, packed, w_scale, None, x.dtype, True)


def _vllm_float(weight: torch.Tensor):
    """The kernel vLLM's ``UnquantizedLinearMethod`` runs on this bf16 ``[N, K]`` weight here (its
    ``dispatch_cpu_unquantized_gemm``), as a function of the activations."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return lambda x: layer.cpu_linear(x, layer.weight, None)


def _copies(make, weight: torch.Tensor, stream_mb: int) -> list:
    """``make(weight)`` for enough copies of ``weight`` to hold ``stream_mb`` MB of bf16 weights (one
    copy for 0: the weight stays in the caches)."""
    count = max(1, -(-stream_mb * 2**20 // (weight.numel() * 2))) if stream_mb else 1
    return [make(weight.clone()) for _ in range(count)]


def _streamed(fns: list):
    """One call of the next function in ``fns`` per call."""
    state = {"i": 0}

    def run(x: torch.Tensor) -> torch.Tensor:
        i = state["i"]
        state["i"] = (i + 1) % len(fns)
        return fns[i](x)

    return run


def _torchq_layer(weight: torch.Tensor, config) -> torch.nn.Linear:
    """A bf16 linear of ``weight`` quantized with ``config``, in the layout the plugin serves it in
    (``serving_layout``: int8 weights with int8 activations on VNNI panels where those fit)."""
    n, k = weight.shape
    layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    torchq.quantize_(layer, config)
    q = layer.weight
    if type(q.act_quant) in (PerTokenInt8, StaticInt8):
        vnni = _served_layout()
        if vnni.fit(q.tensor_impl.spec, tuple(q.shape), q.to_plain().scale.dtype, "cpu").automatic:
            layer.weight = torch.nn.Parameter(q.to_layout(vnni), requires_grad=False)
    return layer


def measure_configs(rows: list[int], rounds: int, reps: int, names: list[str], stream_mb: int,
                    call: str = "direct") -> list[dict]:
    """Each config's layer against vLLM's float kernel and F.linear on the same bf16 weights;
    ``call``: how the torchq layers are called (``direct``: a DirectLinear per layer, as the plugin's
    ``apply``; ``f.linear``)."""
    results = []
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        # a streamed timing takes every copy at least once: fewer calls measure how fast a candidate
        # warms up after the others ran (torchq's per-call Python state, cold then, cost it up to
        # 50 us a call at 10 calls a timing on a Zen 4 core; vLLM's float kernel little)
        calls = max(reps, -(-stream_mb * 2**20 // (weight.numel() * 2))) if stream_mb else reps
        cands = {"vLLM float": _streamed(_copies(_vllm_float, weight, stream_mb)),
                 "F.linear": _streamed(_copies(lambda w: functools.partial(F.linear, weight=w), weight, stream_mb))}
        layouts = {}
        for name in names:
            config = config_from_name(name)
            layers = _copies(lambda w, c=config: _torchq_layer(w, c), weight, stream_mb)
            calls_of = (lambda: F.linear) if call == "f.linear" else DirectLinear
            cands[name] = _streamed([functools.partial(calls_of(), weight=q.weight) for q in layers])
            layouts[name] = layers[0].weight.tensor_impl.layout.name
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            best = dict.fromkeys(cands, float("inf"))
            with torch.no_grad():
                for _ in range(rounds):
                    for name, fn in cands.items():
                        best[name] = min(best[name], _timed(functools.partial(fn, x), calls))
            results.append({"n": n, "k": k, "m": m, "us": best, "layouts": layouts, "stream_mb": stream_mb, "call": call})
    return results


def _served_layout():
    """The layout torchq's vLLM plugin serves int8 weights in here (``torchq.vllm.weights.serving_layout``)."""
    vnni = Int8VnniLayout()
    return vnni if vnni.fit(vnni.examples()[0].spec, None, None, "cpu").automatic else PlainLayout()


def measure(rows: list[int], rounds: int, reps: int) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(weight)
        row_major = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            row_major.weight.copy_(weight)
        torchq.quantize_(layer, torchq.int8_dynamic_activation_int8_weight(layout=_served_layout()))
        torchq.quantize_(row_major, torchq.int8_dynamic_activation_int8_weight(layout=PlainLayout()))
        plain = layer.weight.to_plain()  # the same codes and scales for vLLM's paths
        codes, scales = plain.codes.reshape(n, k).contiguous(), plain.scale.reshape(n).float().contiguous()
        onednn, sgl = _vllm_onednn(codes, scales), _vllm_sgl(codes, scales)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            q, q_plain = layer.weight, row_major.weight
            cands = {"bf16 F.linear": lambda x=x, w=weight: F.linear(x, w), "vLLM oneDNN": lambda x=x, f=onednn: f(x),
                     "torchq int8dq": lambda x=x, q=q: F.linear(x, q), "torchq int8dq plain": lambda x=x, q=q_plain: F.linear(x, q)}
            if sgl is not None:
                cands["vLLM SGL"] = lambda x=x, f=sgl: f(x)
            best = dict.fromkeys(cands, float("inf"))
            with torch.no_grad():
                for _ in range(rounds):
                    for name, fn in cands.items():
                        best[name] = min(best[name], _timed(fn, reps))
                ours = F.linear(x, q).float()
                diff = {name: float((f().float() - ours).abs().max()) for name, f in cands.items() if name.startswith("vLLM")}
                if not torch.equal(F.linear(x, q_plain).float(), ours):
                    raise AssertionError(f"{n} x {k}, M = {m}: the {q.tensor_impl.layout.name} layout's output is not the plain layout's")
            results.append({"n": n, "k": k, "m": m, "us": best, "vllm_runs": "vLLM SGL" if sgl is not None else "vLLM oneDNN",
                            "layout": q.tensor_impl.layout.name,
                            "max_abs_diff": diff})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64,128,256", help="comma-separated activation rows (M)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each candidate keeps its best")
    ap.add_argument("--reps", type=int, default=20, help="calls per timing")
    ap.add_argument("--configs", default="", help="comma-separated torchq configs for the second table (e.g. int4-g32,nf4)")
    ap.add_argument("--stream-mb", type=int, default=0, help="second table: MB of bf16 weights each candidate cycles "
                                                               "through (0: one weight, cache-resident)")
    ap.add_argument("--call", choices=("direct", "f.linear"), default="direct",
                    help="second table: call torchq's layers as the plugin's apply does (direct) or through F.linear")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError as e:
        print(f"bench_vllm_kernels: vLLM is not importable here ({e}); run it in vLLM's environment", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    results = measure([int(r) for r in args.rows.split(",") if r], args.rounds, args.reps)
    print(f"{'layer (N x K)':14} {'M':>4} {'bf16 us':>9} {'oneDNN us':>10} {'SGL us':>9} {'plain us':>9} {'torchq us':>10} "
          f"{'vs vLLM':>8} {'vs bf16':>8} {'vs plain':>8}")
    for r in results:
        us = r["us"]
        sgl = us.get("vLLM SGL")
        print(f"{r['n']:>5} x {r['k']:<6} {r['m']:>4} {us['bf16 F.linear']:>9.1f} {us['vLLM oneDNN']:>10.1f} "
              f"{'-' if sgl is None else f'{sgl:.1f}':>9} {us['torchq int8dq plain']:>9.1f} {us['torchq int8dq']:>10.1f} "
              f"{us[r['vllm_runs']] / us['torchq int8dq']:>7.2f}x {us['bf16 F.linear'] / us['torchq int8dq']:>7.2f}x "
              f"{us['torchq int8dq plain'] / us['torchq int8dq']:>7.2f}x")
    layouts = sorted({r["layout"] for r in results})
    print(f"vs: the other's time / torchq's (above 1: torchq faster), vLLM's the kernel it would run here; torchq: layout "
          f"{', '.join(layouts)}, plain: the row-major layout; {args.threads} threads, best of {args.rounds} interleaved rounds")
    names = [c for c in args.configs.split(",") if c]
    configs = measure_configs([int(r) for r in args.rows.split(",") if r], args.rounds, args.reps, names, args.stream_mb,
                              args.call) if names else []
    if configs:
        where = f"each call a new copy of {args.stream_mb} MB of bf16 weights" if args.stream_mb else "one weight, cache-resident"
        print(f"\ntorchq configs ({args.call} calls) against vLLM's float linear on the bf16 weight (us; x: vLLM float's time / the "
              f"config's); {where}")
        print(f"{'layer (N x K)':14} {'M':>4} {'vLLM float':>10} {'F.linear':>9} " + " ".join(f"{c:>18}" for c in names))
        for r in configs:
            us = r["us"]
            cells = " ".join(f"{us[c]:>10.1f} {us['vLLM float'] / us[c]:>6.2f}x" for c in names)
            print(f"{r['n']:>5} x {r['k']:<6} {r['m']:>4} {us['vLLM float']:>10.1f} {us['F.linear']:>9.1f} {cells}")
        print("layouts: " + ", ".join(f"{c} {layout}" for c, layout in configs[0]["layouts"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "results": results, "configs": configs}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
