"""Process-group workers for tests/test_distributed.py (spawned, gloo on CPU; NCCL on CUDA).

Each scenario is a function ``(rank, world, backend, tmp, *args) -> result``; :func:`spawn` runs
it on one process per rank (:func:`examples.processes.run_local`) and returns every rank's
result (a child's traceback becomes the error)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn


def _scenario(rank: int, world: int, scenario: str, backend: str, tmp: str, args: tuple):
    torch.set_num_threads(1)
    return globals()[scenario](rank, world, backend, Path(tmp), *args)


def spawn(scenario: str, world: int, tmp: Path, *args, backend: str = "gloo") -> list:
    """Run ``scenario`` on ``world`` processes; each rank's result, in rank order."""
    from examples.processes import run_local

    return run_local(_scenario, world, scenario, backend, str(tmp), args, backend=backend)


# -- models -----------------------------------------------------------------------------------------
def settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU once every collective writing it has completed. A tensor-parallel output
    (RowwiseParallel's all-reduce) is an AsyncCollectiveTensor, and ``.cpu()`` of a CPU tensor
    returns the tensor itself, waiting for nothing: read after the worker returns, the last
    all-reduce of a run could still be in flight (seen: one rank's output off by ~1.8, ~1 run in 3)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    return t.cpu().clone()


def adapter(base: nn.Linear) -> nn.Module:
    """A rank-4 adapter, seeded by the layer's shape, with a non-zero B so A has gradients."""
    from examples.lora import LoRALinear

    g = torch.Generator().manual_seed(base.in_features * 1000 + base.out_features)
    return LoRALinear(base, rank=4, b_std=0.05, generator=g)


def build_net() -> nn.Module:
    """Two residual MLP blocks (64 -> 128 -> 64, relu) and a 6-row head: over 4 ranks the head's
    rows go 2, 2, 2, 0 (one rank holds an empty shard: only padding in the all-gather)."""
    from examples.mlp import ResidualMLP

    return ResidualMLP(64, 128, depth=2, classes=6, activation="relu")


def config(name: str):
    import torchq

    if name == "nf4-single":
        return torchq.nf4_weight_only(double_quant=False)
    return torchq.config_from_name(name)


def quantized_net(name: str, device: str = "cpu", lora: bool = True) -> nn.Module:
    import torchq

    torch.manual_seed(0)
    m = build_net()
    torchq.quantize_(m, config(name))
    for p in m.parameters():
        p.requires_grad_(False)
    if lora:
        for b in m.blocks:
            b.up, b.down = adapter(b.up), adapter(b.down)
        m.head = adapter(m.head)
    return m.to(device)


def batches(steps: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=g).to(device), torch.randint(0, 6, (8,), generator=g).to(device)) for _ in range(steps)]


def lora_grads(m: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in m.named_parameters():
        if "lora_" in n and p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out


def train(m: nn.Module, steps: int, device: str = "cpu", record_grads: bool = False):
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    losses, grads = [], []
    for x, y in batches(steps, device):
        loss = nn.functional.cross_entropy(m(x).float(), y)
        loss.backward()
        losses.append(loss.item())
        if record_grads:
            grads.append(lora_grads(m))
        opt.step()
        opt.zero_grad()
    return losses, grads


def shard(m: nn.Module, mesh, **kw) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for b in m.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(m, mesh=mesh, **kw)
    return m


def quantized_weights(m: nn.Module) -> dict[str, torch.Tensor]:
    from torchq import AffineQuantizedTensor

    out = {}
    for n, p in m.named_parameters():
        local = p._local_tensor if hasattr(p, "_local_tensor") else p
        if isinstance(local, AffineQuantizedTensor):
            out[n] = local
    return out


# -- scenarios ---------------------------------------------------------------------------------------
def fsdp_qlora(rank, world, backend, tmp, configs, steps=3):
    """QLoRA steps under FSDP2 against the same steps on one process (computed here, no
    collectives), per config: losses, adapter gradients, shard sizes and all-gather bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    out = {}
    for name in configs:
        ref_losses, ref_grads = train(quantized_net(name, device), steps, device, record_grads=True)
        whole = {n: w.nbytes_quantized() for n, w in quantized_weights(quantized_net(name, device)).items()}
        m = shard(quantized_net(name, device), mesh)
        local = {n: w.nbytes_quantized() for n, w in quantized_weights(m).items()}
        gathered = []
        original = dist.all_gather_single

        def counting(output, input, *a, gathered=gathered, original=original, **k):
            gathered.append(output.numel() * output.element_size())
            return original(output, input, *a, **k)

        dist.all_gather_single = counting
        try:
            losses, grads = train(m, steps, device, record_grads=True)
        finally:
            dist.all_gather_single = original
        out[name] = dict(ref_losses=ref_losses, losses=losses, ref_grads=ref_grads, grads=grads, whole=whole, local=local,
                         gathered=sum(gathered), steps=steps)
    return out


def fsdp_policies(rank, world, backend, tmp, name):
    """Mixed precision (bf16 params) and CPU offload: the gathered weight holds the original
    codes and scales bit for bit; offload matches the plain run's losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    original = {n: w.to_plain() for n, w in quantized_weights(quantized_net(name, device)).items()}
    m = shard(quantized_net(name, device), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = {}

    def capture(mod, args, name):
        w = mod.weight
        seen[name] = (w.dtype, w.to_plain().map(torch.clone))  # FSDP2 frees the gathered storage after forward

    for n, mod in m.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_pre_hook(lambda mod, args, n=n: capture(mod, args, n))
    mp_losses, _ = train(m, 2, device)
    same = {}
    for n, (dtype, plain) in seen.items():
        ref = original[f"{n}.weight"]
        same[n] = (dtype, _plain_equal(plain, ref))
    plain_losses, _ = train(shard(quantized_net(name, device), mesh), 2, device)
    offload_losses, _ = train(shard(quantized_net(name, device), mesh, offload_policy=CPUOffloadPolicy(pin_memory=False)), 2, device)
    return dict(same=same, mp_losses=mp_losses, plain_losses=plain_losses, offload_losses=offload_losses)


def _plain_equal(a, b) -> bool:
    """Bit equality of two plain forms' values: codes, zero points and (reconstructed) scales."""
    if not torch.equal(a.codes.cpu(), b.codes.cpu()) or not torch.equal(a.scale.cpu(), b.scale.cpu()):
        return False
    if (a.zero_point is None) != (b.zero_point is None):
        return False
    return a.zero_point is None or torch.equal(a.zero_point.cpu(), b.zero_point.cpu())


def tensor_parallel(rank, world, backend, tmp, name):
    """ColwiseParallel / RowwiseParallel on quantized linears: each rank's shard is the quantized
    shard of the float weight; outputs against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torchq

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    m = build_net().to(device)
    floats = {n: p.detach().clone() for n, p in m.named_parameters()}
    torchq.quantize_(m, config(name))
    whole = {n: w.to_plain() for n, w in quantized_weights(m).items()}
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        ref = {i: (m.blocks[i].up(x), m.blocks[i].down(torch.relu(m.blocks[i].up(x)))) for i in range(2)}
        ref_out = m(x)
    plan = {}
    for i in range(2):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(m, mesh, plan, src_data_rank=None)
    shard_is_quantized_shard = {}
    for n, p in m.named_parameters():
        if not n.endswith("weight") or n.startswith("head"):
            continue
        dim = 0 if ".up." in n else 1
        piece = floats[n].chunk(world, dim=dim)[rank]
        expect = torchq.AffineQuantizedTensor  # quantize the float piece on its own
        q = nn.Linear(piece.shape[1], piece.shape[0], bias=False).to(device)
        q.weight.data.copy_(piece)
        torchq.quantize_(nn.Sequential(q), config(name))
        assert isinstance(q.weight, expect)
        if whole[n].nested is None:  # exactly the quantized piece of the float weight
            shard_is_quantized_shard[n] = _plain_equal(p._local_tensor.to_plain(), q.weight.to_plain())
        else:  # double-quantized scales span the whole weight: the piece holds their fp32 values
            rows = whole[n].shape[dim] // world
            shard_is_quantized_shard[n] = (torch.equal(p._local_tensor.to_plain().codes, q.weight.to_plain().codes)
                                           and _plain_equal(p._local_tensor.to_plain(), whole[n].narrow(dim, rank * rows, rows)))
    with torch.no_grad():
        up = {i: m.blocks[i].up(x) for i in range(2)}
        out = m(x)
    col_equal = {i: torch.equal(up[i], ref[i][0].chunk(world, dim=-1)[rank]) for i in range(2)}
    return dict(shard_is_quantized_shard=shard_is_quantized_shard, col_equal=col_equal,
                out=settled(out), ref_out=settled(ref_out), x=x.cpu())


def dcp_save(rank, world, backend, tmp, name, folder, kind="fsdp"):
    """Train one step sharded (FSDP2 or TP), save with DCP; rank 0 also returns the outputs the
    saved model gives, which a load on another world size must reproduce."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torchq.distributed import checkpoint as tqdcp

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    m = quantized_net(name, device, lora=kind == "fsdp")
    if kind == "fsdp":
        shard(m, mesh)
        train(m, 1, device)
    else:
        parallelize_module(m, mesh, {"blocks.0.up": ColwiseParallel(), "blocks.0.down": RowwiseParallel(),
                                     "blocks.1.up": ColwiseParallel(), "blocks.1.down": RowwiseParallel()},
                           src_data_rank=None)
    sd = tqdcp.state_dict(m)
    dcp.save(sd, checkpoint_id=str(tmp / folder))
    x = batches(1, device)[0][0]
    with torch.no_grad():
        y = m(x)
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    return dict(y=settled(y), keys=sorted(sd))


def dcp_load(rank, world, backend, tmp, name, folder, lora=True):
    """Load a DCP checkpoint into a model built and sharded (FSDP2) on this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from torchq.distributed import checkpoint as tqdcp

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(123)
    m = quantized_net(name, device, lora=lora)
    shard(m, mesh)
    sd = tqdcp.state_dict(m)
    dcp.load(sd, checkpoint_id=str(tmp / folder))
    tqdcp.load_state_dict(m, sd)
    x = batches(1, device)[0][0]
    with torch.no_grad():
        y = m(x)
    local = {n: w.nbytes_quantized() for n, w in quantized_weights(m).items()}
    return dict(y=settled(y), local=local)


def single_file_load(rank, world, backend, tmp, name, path, kind="fsdp"):
    """A torchq.save_quantized file into a model quantized on the meta device and sharded:
    the rows each rank read, and the outputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torchq
    from torchq.distributed import checkpoint as tqdcp
    from torchq.distributed import sharded_file

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    with torch.device("meta"):
        m = build_net()
    torchq.quantize_(m, config(name))
    if kind == "fsdp":
        shard(m, mesh)
    else:
        parallelize_module(m, mesh, {"blocks.0.up": ColwiseParallel(), "blocks.0.down": RowwiseParallel(),
                                     "blocks.1.up": ColwiseParallel(), "blocks.1.down": RowwiseParallel()},
                           src_data_rank=None)
    reads = []
    original = sharded_file.SliceReader.read

    def recording(self, key, rows=None, cols=None):
        t = original(self, key, rows, cols)
        reads.append((key, tuple(t.shape)))
        return t

    sharded_file.SliceReader.read = recording
    try:
        tqdcp.load_quantized_sharded(m, path)
    finally:
        sharded_file.SliceReader.read = original
    if device != "cpu":
        m.to(device)
    x = batches(1, device)[0][0]
    with torch.no_grad(), torchq.strict():  # loaded into the CPU's layouts: their kernels, no fallback
        y = m(x)
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    return dict(y=settled(y), reads=reads)


def failing(rank, world, backend, tmp):
    if rank == 1:
        raise ValueError("rank one fails")
    return rank


def _qat_net(name: str, scales: str = "recompute") -> nn.Module:
    import torchq.qat

    torch.manual_seed(0)
    return torchq.qat.prepare(build_net(), config(name), scales=scales)


def _full_fine_tune(m: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    for x, y in batches(steps):
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def fsdp_qat(rank, world, backend, tmp, configs, steps=3):
    """QAT (every weight trained through its quantizer) under FSDP2 against the same steps on one
    process, per config: losses, the trained float weights (gathered) and the converted model's
    outputs from those weights."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchq.qat

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in configs:
        ref = _qat_net(name)
        ref_losses = _full_fine_tune(ref, steps)
        m = shard(_qat_net(name), mesh)
        losses = _full_fine_tune(m, steps)
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in m.named_parameters()}
        plain = _qat_net(name)
        plain.load_state_dict(full)
        x = batches(1)[0][0]
        with torch.no_grad():
            prepared = plain(x)
            torchq.qat.convert(plain)
            converted = plain(x)
        out[name] = dict(ref_losses=ref_losses, losses=losses, ref_weights={n: p.detach() for n, p in ref.named_parameters()},
                         weights=full, prepared=prepared, converted=converted)
    return out


# -- tensor parallelism from a source rank (the default src_data_rank=0) --------------------------------
def tp_layout_cases() -> list[tuple[str, object, object, torch.dtype, bool]]:
    """``(name, layout, spec(k), scale dtype, spans_row)`` for every registered layout (each in a
    format it holds on the CPU), plus the per-row formats with a zero point (integer and float)."""
    from torchq.canonical import QuantSpec
    from torchq.layouts import (
        Blockwise4bitLayout,
        Float8Layout,
        Int4CPULayout,
        Int4NativeLayout,
        Int4XPULayout,
        PackedBitsLayout,
        PlainLayout,
        TensorCoreTiledLayout,
    )
    from torchq.primitives import ZeroPointDomain as Z

    def grouped(g, qmin, qmax, domain, **kw):
        return lambda k: QuantSpec((1, g), qmin, qmax, domain, **kw)

    def per_row(qmin, qmax, domain, **kw):
        return lambda k: QuantSpec((1, k), qmin, qmax, domain, **kw)

    return [
        ("plain-int8-per-row", PlainLayout(), per_row(-128, 127, Z.NONE), torch.float32, True),
        ("plain-int4-per-row-float-zero", PlainLayout(), per_row(0, 15, Z.FLOAT), torch.float32, True),
        ("packed_bits-4bit-per-row-int-zero", PackedBitsLayout(), per_row(0, 15, Z.INT), torch.float32, True),
        ("packed_bits-3bit-g32", PackedBitsLayout(), grouped(32, 0, 7, Z.INT), torch.bfloat16, False),
        ("int4_cpu-g32", Int4CPULayout(), grouped(32, 0, 15, Z.INT), torch.float32, False),
        ("int4_native-g32", Int4NativeLayout(), grouped(32, 0, 15, Z.FLOAT), torch.float32, False),
        ("int4_xpu-g32", Int4XPULayout(), grouped(32, 0, 15, Z.INT), torch.bfloat16, False),
        ("tensor_core_tiled-g32", TensorCoreTiledLayout(inner_k_tiles=2), grouped(32, -8, 7, Z.NONE), torch.bfloat16, False),
        ("blockwise_4bit-nf4-double", Blockwise4bitLayout(), grouped(64, 0, 15, Z.NONE, codebook="nf4", double_quant=True),
         torch.float32, False),
        ("float8-per-row", Float8Layout(), per_row(0, 255, Z.NONE, codebook="e4m3fn"), torch.float32, True),
    ]


def _example_weight(layout, spec, shape, scale_dtype, seed: int, device: str):
    from torchq import AffineQuantizedTensor
    from torchq.canonical import PlainForm

    plain = PlainForm.example(spec, shape, scale_dtype, seed=seed)
    return AffineQuantizedTensor.from_plain(plain, torch.float32, layout=layout).to(device)


def _tp_mlp(case, seed: int, device: str, hidden: int = 256) -> nn.Module:
    """Linear(64 -> hidden) (ColwiseParallel), relu, Linear(hidden -> 64) (RowwiseParallel), the
    weights random codes of ``case``'s format in its layout, the biases random floats (all from ``seed``)."""
    _, layout, spec, scale_dtype, _ = case
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 64))
    for i, (n, k) in ((0, (hidden, 64)), (2, (64, hidden))):
        lin = m[i]
        lin.weight = nn.Parameter(_example_weight(layout, spec(k), (n, k), scale_dtype, seed * 10 + i, "cpu"),
                                  requires_grad=False)
        lin.bias = nn.Parameter(torch.randn(n, generator=g) * 0.1, requires_grad=False)
    return m.to(device)


def _same_shard(local, expect) -> bool:
    """Bit for bit the same plain form, in the same layout (packed metadata)."""
    return bool(local.to_plain().equal(expect.to_plain()) and local.tensor_impl.metadata() == expect.tensor_impl.metadata())


def _chunk(w, world: int, dim: int, rank: int):
    """The piece of ``w`` a rank cuts itself (DTensor's rule): ``torch.chunk``, and where it gives
    fewer pieces than ranks, ``new_zeros`` of the first piece with nothing along ``dim``."""
    pieces = torch.chunk(w, world, dim=dim)
    if rank < len(pieces):
        return pieces[rank]
    size = list(pieces[0].shape)
    size[dim] = 0
    return pieces[0].new_zeros(size)


def _local_seed(true_seed: int, rank: int, src) -> int:
    """The seed a rank builds its weights from: the true one on the source rank (every rank when
    src is None), other values elsewhere (a scatter must overwrite them)."""
    return true_seed if src is None or rank == src else true_seed + 7919 * (rank + 1)


def tp_scatter(rank, world, backend, tmp, names=None):
    """ColwiseParallel + RowwiseParallel with src_data_rank 0, the last rank and None, for every
    layout of :func:`tp_layout_cases`; uneven row and column splits through distribute_tensor.
    Ranks other than the source hold other values. Per check: whether this rank's shard is bit for
    bit ``torch.chunk`` of the source's weight in its layout; the outputs against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(device)
    cases = [c for c in tp_layout_cases() if names is None or c[0] in names]
    shards, col_equal, rowwise = {}, {}, {}
    for ci, case in enumerate(cases):
        name = case[0]
        true = _tp_mlp(case, 100 + ci, device)
        with torch.no_grad():
            h_ref = true[0](x)
            y_ref = true(x)
        for src in (0, world - 1, None):
            key = f"{name} src={src}"
            m = _tp_mlp(case, _local_seed(100 + ci, rank, src), device)
            parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=src)
            for i, dim in ((0, 0), (2, 1)):
                local = m[i].weight._local_tensor
                shards[f"{key} weight {i}"] = _same_shard(local, _chunk(true[i].weight, world, dim, rank))
            shards[f"{key} biases"] = (torch.equal(m[0].bias._local_tensor, true[0].bias.chunk(world)[rank])
                                       and torch.equal(m[2].bias._local_tensor, true[2].bias))
            with torch.no_grad():
                h = m[0](x)
                y = m(x)
            col_equal[key] = torch.equal(h, h_ref.chunk(world, dim=-1)[rank])
            rowwise[key] = (settled(y), settled(y_ref), _rowwise_bound(true, x).cpu())
        # uneven splits: rows (the last ranks fewer or none), and columns of formats whose blocks span the row
        _, layout, spec, scale_dtype, spans = case
        shapes = [(0, (7, 64)), (0, (6, 64))] + ([(1, (8, 71))] if spans else [])
        if name == "plain-int8-per-row":  # K = 3 over 4 ranks: 1 + 1 + 1 + an empty column shard
            shapes.append((1, (8, 3)))
        for dim, shape in shapes:
            whole = _example_weight(layout, spec(shape[1]), shape, scale_dtype, 7 + ci, device)
            for src in (0, None):
                mine = whole if src is None or rank == src else _example_weight(layout, spec(shape[1]), shape, scale_dtype,
                                                                                 8 + ci + rank, device)
                d = distribute_tensor(mine, mesh, [Shard(dim)], src_data_rank=src)
                shards[f"{name} uneven {shape} Shard({dim}) src={src}"] = (
                    tuple(d.shape) == shape and _same_shard(d._local_tensor, _chunk(whole, world, dim, rank)))
    return dict(shards=shards, col_equal=col_equal, rowwise=rowwise)


def _rowwise_bound(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fp32 summation-order bound of the RowwiseParallel layer's output, per element:
    ``2 * K * eps * (|h| @ |W|^T + |b|)`` with ``h`` its input and ``K`` the reduced length."""
    with torch.no_grad():
        h = m[1](m[0](x)).float()
        w = m[2].weight.dequantize(torch.float32)
        k = w.shape[1]
        return 2 * k * torch.finfo(torch.float32).eps * (h.abs() @ w.abs().t() + m[2].bias.abs())


def tp_rowwise_per_channel(rank, world, backend, tmp, configs):
    """RowwiseParallel on an nn.Linear(512, 256) quantized with each config (per-row formats), with
    the default src_data_rank (0) and None: shards against the one-process weight's columns, and the
    outputs, the input and the dequantized weight for the test's bounds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import torchq

    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5)).to(device)
    out = {}
    for name in configs:
        cfg = per_channel_config(name)
        torch.manual_seed(11)
        whole = nn.Sequential(nn.Linear(512, 256)).to(device)
        torchq.quantize_(whole, cfg)
        with torch.no_grad():
            y_ref = whole(x)
        spec = whole[0].weight.spec
        for src in (0, None):
            torch.manual_seed(11 if src is None or rank == src else 11 + rank + 1)
            m = nn.Sequential(nn.Linear(512, 256)).to(device)
            torchq.quantize_(m, cfg)
            parallelize_module(m, mesh, {"0": RowwiseParallel(input_layouts=Replicate())}, src_data_rank=src)  # x whole
            local = m[0].weight._local_tensor
            same = _same_shard(local, _chunk(whole[0].weight, world, 1, rank))
            with torch.no_grad():
                y = m(x)
            out[f"{name} src={src}"] = dict(same=same, local_block=tuple(local.spec.block_size), block=tuple(spec.block_size),
                                            y=settled(y), y_ref=settled(y_ref))
        out[name] = dict(x=x.cpu(), w=whole[0].weight.dequantize(torch.float32).cpu(), b=whole[0].bias.detach().cpu())
    return out


def per_channel_config(name: str):
    """The configs whose weight blocks span the row (one scale per output row), by name."""
    import torchq
    from torchq.activation import StaticInt8

    if name == "intx4-per-channel":  # asymmetric: an integer zero point per row
        return torchq.intx_weight_only(bits=4, group_size=None)
    if name == "int8static":
        from torchq.configs import Int8StaticActivationInt8WeightConfig

        return Int8StaticActivationInt8WeightConfig(activation=StaticInt8.from_range(-4.0, 4.5))
    if name == "llm_int8":
        return torchq.llm_int8()
    return torchq.config_from_name(name)


def tp_mismatch(rank, world, backend, tmp):
    """Rank 1 quantized its model with another format: every rank's error (None if it did not raise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import torchq

    mesh = init_device_mesh("cpu", (world,))
    m = nn.Sequential(nn.Linear(64, 32))
    m[0].weight.requires_grad_(False)
    torchq.quantize_(m, torchq.config_from_name("int4-g32" if rank == 1 else "int8wo"))
    try:
        parallelize_module(m, mesh, {"0": ColwiseParallel()})
    except ValueError as e:
        return str(e)
    return None


def tp_src_rank(rank, world, backend, tmp, configs, names=None):
    """:func:`tp_scatter` and :func:`tp_rowwise_per_channel` in one process group (one spawn). The
    layouts whose kernels need another device fall back to dequantize + F.linear on the CPU, with
    the warning that says so (silenced here)."""
    import warnings

    from torchq.dispatch import FallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return dict(layouts=tp_scatter(rank, world, backend, tmp, names),
                    per_channel=tp_rowwise_per_channel(rank, world, backend, tmp, configs))
