"""Tutorial 2 - your own layout and the kernels it owns.

    python tutorials/02_custom_layout_and_kernel.py

A layout is a storage format that converts losslessly to and from torchq's canonical plain form
(integer codes + scales + zero points). Here: int8 per-channel weights stored TRANSPOSED,
``codes_t`` int8 [K, N] with fp32 scales [N] (a format some matmul kernels prefer). Its kernel is a
torch.library op with a fake implementation, so torch.compile(fullgraph=True) traces it. The layout
lists its kernels (``linear_kernels()``): the dispatch tries them, in order, for weights in it.
"""

from dataclasses import dataclass

import torch
from torch import nn

import torchq
from torchq.canonical import PlainForm
from torchq.layouts import Fit, Layout, LayoutExample, TensorImpl


# 1. The TensorImpl: which tensors it holds, and the two conversions.
class TransposedInt8Impl(TensorImpl):
    tensor_fields = ("codes_t", "scale")  # flattening, clone, .to(), detach come from these names

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> "TransposedInt8Impl":
        return cls(layout, plain.spec, plain.shape, codes_t=plain.codes.t().contiguous(), scale=plain.scale)

    def to_plain(self) -> PlainForm:
        return PlainForm(self.codes_t.t().contiguous(), self.scale, None, self.spec)


# 2. The Layout: a frozen dataclass that says what it can hold (and why not), and its kernels.
@dataclass(frozen=True)
class TransposedInt8Layout(Layout):
    name = "tutorial_transposed_int8"
    impl_class = TransposedInt8Impl

    @classmethod
    def linear_kernels(cls):
        return KERNELS  # defined below, with the op they call

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        """Can it hold the weight (``Fit(reason)`` if not)? None arguments are not known yet.
        A layout that automatic choice should skip somewhere says ``Fit(not_automatic=reason)``."""
        base = super().fit(spec, shape, scale_dtype, device)  # the checks every layout shares
        if not base.holds:
            return base
        if spec.code_dtype != torch.int8 or spec.zero_point_domain.name != "NONE":
            return Fit(f"holds symmetric int8 codes only, got {spec.describe()}")
        if shape is not None and spec.block_size != (1, shape[1]):
            return Fit(f"needs one scale per output channel, got blocks {spec.block_size}")
        return base

    @classmethod
    def examples(cls):
        """Weights it holds (format, shape, scale dtype). torchq's layout contract tests run every
        registered layout on its examples: lossless round trip, slices, copy_, .to(), checkpoints,
        torch.compile and every kernel against the reference."""
        none = torchq.ZeroPointDomain.NONE
        return (LayoutExample(cls(), torchq.QuantSpec((1, 96), -128, 127, none), (64, 96)),
                LayoutExample(cls(), torchq.QuantSpec((1, 50), -127, 127, none), (33, 50), torch.bfloat16))


# 3. The kernel: a custom op (+ fake for compile), and a LinearKernel (condition, impl).
@torch.library.custom_op("tutorial::transposed_int8_mm", mutates_args=())
def transposed_int8_mm(x: torch.Tensor, codes_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() @ codes_t.float() * scale.reshape(1, -1).float()).to(x.dtype)


@transposed_int8_mm.register_fake
def _(x, codes_t, scale):
    return x.new_empty(x.shape[0], codes_t.shape[1])


def accepts(x, weight, bias):
    """None to accept, or the reason to reject (shown by torchq.explain and fallback warnings). It
    is only asked about weights in TransposedInt8Layout, with inputs of a dtype in ``dtypes``."""
    if weight.act_quant is not None:
        return "weight-only kernel"
    return None


def run(x, weight, bias):
    n, k = weight.tensor_impl.shape
    y = transposed_int8_mm(x.reshape(-1, k), weight.codes_t, weight.scale).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


KERNELS = (torchq.LinearKernel("tutorial_transposed_int8", accepts, run, description="x @ codes_t * scale",
                                dtypes=(torch.float32, torch.bfloat16, torch.float16)),)

# The examples convert losslessly (a random plain form of each, packed and unpacked).
for example in TransposedInt8Layout.examples():
    plain = PlainForm.example(example.spec, example.shape, example.scale_dtype)
    assert example.layout.pack(plain).to_plain().equal(plain)

# 4. Use it: any int8 per-channel config can name the layout.
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64))
x = torch.randn(3, 256)
reference = model(x)
torchq.quantize_(model, torchq.int8_weight_only(layout=TransposedInt8Layout()))
with torchq.strict():  # strict: raise instead of falling back, so we know our kernel ran
    y = model(x)
report = torchq.explain(model, x)
print(report)
assert set(report.kernels().values()) == {"tutorial_transposed_int8"}
assert (y - reference).norm() / reference.norm() < 0.01

# Lossless conversion to any other layout that holds the format (here the built-in PlainLayout),
# so checkpoints written from this layout load anywhere.
w_plain = model[0].weight.to_layout(torchq.layouts.PlainLayout())
assert w_plain.to_plain().equal(model[0].weight.to_plain())
compiled = torch.compile(model, fullgraph=True)
assert torch.allclose(compiled(x), y, atol=1e-5)

# 5. Someone else's kernel for this layout (or for a built-in one): register_linear_kernel names
# the layout and, optionally, its place in the layout's list (default: ahead of the layout's own).
calls = []


def counting_run(x, weight, bias):
    calls.append(tuple(x.shape))
    return run(x, weight, bias)


torchq.register_linear_kernel("tutorial_counting", accepts, counting_run, layout=TransposedInt8Layout,
                              before="tutorial_transposed_int8")
print([k.name for k in torchq.linear_kernels(TransposedInt8Layout)])
assert torch.equal(model(x), y) and calls == [(3, 256), (3, 512)]
torchq.unregister_linear_kernel("tutorial_counting")

# 6. compute_dtype: a config can ask for a compute dtype; inputs of another dtype are cast to it
# and the outputs cast back (explain shows it).
torchq.quantize_(model2 := nn.Sequential(nn.Linear(256, 64)), torchq.int8_weight_only(
    layout=TransposedInt8Layout(), compute_dtype=torch.bfloat16))
print(torchq.explain(model2, x))
assert model2(x).dtype == torch.float32
print("custom layout and kernel: OK")
