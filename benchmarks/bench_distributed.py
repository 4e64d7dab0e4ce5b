"""QLoRA under FSDP2 on 1, 2 and 4 CPU processes (gloo): a float base against an NF4 base.

The model: ``--layers`` residual MLP blocks (``d -> hidden -> d``, default 12 x 1024 x 4096:
101M base parameters) with rank-8 LoRA adapters on every linear. Each process builds the model
on the meta device and is sharded with ``fully_shard`` per block and at the root before it holds
any weight, so no rank ever holds the whole model:

* ``float``: the sharded float weights are materialized (``to_empty``) and initialized in place;
* ``nf4``: the model is quantized on the meta device, sharded, and each rank reads its rows of
  an NF4 checkpoint (``torchq.save_quantized`` of the model with its adapters, written once by
  the parent) with
  ``torchq.distributed.checkpoint.load_quantized_sharded``.

Columns, per rank (the largest over ranks): ``held`` MiB of base weights a rank holds (its
shards), ``peak`` MiB of resident memory above the process's footprint after imports, during
setup and the timed steps (``/proc/self/status`` VmHWM, reset after imports; ``setup``: the
same before the first step), ``step`` median
seconds per optimizer step, each rank on its own batch of ``--batch`` x ``--seq`` tokens (data
parallel: the global batch grows with the world size), ``gathered`` MiB that
FSDP2's all-gathers received per step, and ``vs float`` its ratio to the float run's at the same
world size. Threads per process: ``cores // world``. On this 2-core machine 4 processes share 2
cores: step times at world 4 measure oversubscription, not scaling.

    python benchmarks/bench_distributed.py
    python benchmarks/bench_distributed.py --worlds 1,2 --layers 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
from examples.lora import LoRALinear
from examples.mlp import ResidualMLP
from examples.processes import run_local


def build_model(layers: int, d: int, hidden: int) -> ResidualMLP:
    return ResidualMLP(d, hidden, depth=layers, bias=False)


def add_lora(m: ResidualMLP) -> None:
    for b in m.blocks:
        b.up, b.down = LoRALinear(b.up), LoRALinear(b.down)  # rank 8, B = 0 at first


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith(("VmRSS:", "VmHWM:"))}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident size
        f.write("5")


def _child(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchq
    from torchq.distributed import checkpoint as tqdcp

    mesh = init_device_mesh("cpu", (world,))
    base_rss = _status()["VmRSS"]
    _reset_peak()
    torch.manual_seed(0)
    with torch.device("meta"):
        m = build_model(args["layers"], args["d"], args["hidden"])
    if args["config"] != "float":
        torchq.quantize_(m, torchq.config_from_name(args["config"]))
    for p in m.parameters():  # QLoRA either way: only the adapters train
        p.requires_grad_(False)
    add_lora(m)
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    if args["config"] == "float":
        lora = {n: p.full_tensor().detach().clone() for n, p in m.named_parameters() if "lora_" in n}
        m.to_empty(device="cpu")
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.distributed.tensor.distribute_tensor(lora[n], mesh, p.placements, src_data_rank=None))
                else:
                    p._local_tensor.normal_(0, 0.02, generator=g)
    else:
        tqdcp.load_quantized_sharded(m, args["checkpoint"])
    held = 0
    for n, p in m.named_parameters():
        if "lora_" in n:
            continue
        local = p._local_tensor
        held += local.nbytes_quantized() if hasattr(local, "nbytes_quantized") else local.numel() * local.element_size()
    setup_peak = _status()["VmHWM"] - base_rss
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args["batch"], args["seq"], args["d"], generator=gen)
    target = torch.randn(args["batch"], args["seq"], args["d"], generator=gen)
    gathered: list[int] = []
    original = dist.all_gather_single

    def counting(output, input, *a, **k):
        gathered.append(output.numel() * output.element_size())
        return original(output, input, *a, **k)

    times, losses = [], []
    for step in range(args["steps"] + 1):
        gathered.clear()
        dist.all_gather_single = counting
        dist.barrier()
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(m(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        dist.all_gather_single = original
        if step:  # the first step is a warm-up
            times.append(dt)
        losses.append(loss.item())
    status = _status()
    return dict(rank=rank, held=held, setup=setup_peak, peak=status["VmHWM"] - base_rss, step=statistics.median(times),
                gathered=sum(gathered), losses=losses)


def run(config: str, world: int, args: argparse.Namespace, checkpoint: str) -> dict:
    spec = dict(config=config, layers=args.layers, d=args.d, hidden=args.hidden, batch=args.batch, seq=args.seq,
                steps=args.steps, checkpoint=checkpoint)
    ranks = run_local(_child, world, spec, threads=max(1, (os.cpu_count() or 1) // world))
    return dict(config=config, world=world, held=max(r["held"] for r in ranks), setup=max(r["setup"] for r in ranks),
                peak=max(r["peak"] for r in ranks),
                step=max(r["step"] for r in ranks), gathered=max(r["gathered"] for r in ranks), losses=ranks[0]["losses"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--configs", default="float,nf4")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torchq

    params = args.layers * 2 * args.d * args.hidden
    print(f"model: {args.layers} blocks {args.d}x{args.hidden}, {params / 1e6:.1f}M base parameters, rank-8 LoRA; "
          f"batch {args.batch}x{args.seq}; torch {torch.__version__}, {os.cpu_count()} cores")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {}
        for config in args.configs.split(","):
            if config == "float":
                continue
            torch.manual_seed(0)
            m = build_model(args.layers, args.d, args.hidden)
            for p in m.parameters():
                nn.init.normal_(p.data, 0, 0.02)
            torchq.quantize_(m, torchq.config_from_name(config))
            add_lora(m)  # the checkpoint's names are the sharded model's (its adapters start as saved)
            checkpoints[config] = str(Path(tmp) / f"{config}.safetensors")
            torchq.save_quantized(m, checkpoints[config])
            del m
        for world in (int(w) for w in args.worlds.split(",")):
            for config in args.configs.split(","):
                rows.append(run(config, world, args, checkpoints.get(config, "")))
                sys.stdout.flush()
    float_gather = {r["world"]: r["gathered"] for r in rows if r["config"] == "float"}
    mib = 1 << 20
    print(f"{'config':8} {'world':>5} {'held MiB':>9} {'setup MiB':>9} {'peak MiB':>9} {'step s':>7} {'gathered MiB':>13} "
          f"{'vs float':>8}")
    for r in rows:
        ratio = r["gathered"] / float_gather[r["world"]] if float_gather.get(r["world"]) else float("nan")
        r["gathered_vs_float"] = ratio
        print(f"{r['config']:8} {r['world']:>5} {r['held'] / mib:>9.1f} {r['setup'] / mib:>9.1f} {r['peak'] / mib:>9.1f} {r['step']:>7.2f} "
              f"{r['gathered'] / mib:>13.1f} {ratio:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
