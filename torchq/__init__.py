"""torchq: tensor-subclass quantization for PyTorch.

    import torchq
    torchq.quantize_(model, torchq.int4_weight_only())
"""

# the ops first, then the backends registering against them, then the layouts
from . import ops  # noqa: I001
from . import backends  # noqa: I001
from . import blockwise, distributed, interop, layouts, native, optim, primitives, qat, static
from .activation import Float8Activations, OutlierInt8, PerBlockInt8, PerTokenInt8, StaticInt8
from .autotune import AutoquantResult, autoquant, load_plan, save_plan
from .calibrate import CalibrationResult, calibrate
from .canonical import PlainForm, QuantSpec
from .checkpoint import CheckpointError, LoadWarning, init_meta_buffers, load_quantized, save_quantized
from .serialization import _rebuild_object as _rebuild_object  # pinned pickle path
from .serialization import _rebuild_quantized_tensor as _rebuild_quantized_tensor  # pinned pickle path
from .configs import (
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    LayerNotSupported,
    LLMInt8Config,
    NF4WeightOnlyConfig,
    QuantConfig,
    config_from_json,
    config_from_name,
    fp4_weight_only,
    int4_weight_only,
    int8_dynamic_activation_int8_weight,
    int8_static_activation_int8_weight,
    int8_weight_only,
    intx_weight_only,
    llm_int8,
    Int8DynamicActivation4BitWeightConfig,
    int8_dynamic_activation_4bit_weight,
    nf4_weight_only,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    float8_dynamic_activation_float8_weight,
    float8_weight_only,
)
from .dispatch import (
    ALL_LAYOUTS,
    FallbackWarning,
    LinearKernel,
    NoKernelError,
    is_strict,
    linear_kernels,
    register_linear_kernel,
    set_strict,
    strict,
    unregister_linear_kernel,
)
from .explain import ExplainReport, explain
from .layouts import Layout, TensorImpl, choose_layout, layout_from_json
from .primitives import MappingType, ZeroPointDomain
from .quantize import QuantizationError, SkippedLayerWarning, TiedWeightWarning, quantize_
from .tensor import AffineQuantizedTensor
from ._version import __version__ as __version__

from . import hf  # noqa: E402  (imports no transformers: its names do, on first use)
from .hf import saving as _hf_saving  # noqa: E402,F401  (save_pretrained for models quantize_ / load_quantized fill)
from .hf.hook import install_registration_hook as _install_registration_hook  # noqa: E402

_install_registration_hook()  # quant_method "torchq" in transformers, once transformers loads models


__all__ = [
    "ops",
    "backends",
    "hf",
    "qat",
    "static",
    "optim",
    "AffineQuantizedTensor",
    "AutoquantResult",
    "autoquant",
    "load_plan",
    "calibrate",
    "CalibrationResult",
    "save_plan",
    "CheckpointError",
    "LoadWarning",
    "init_meta_buffers",
    "load_quantized",
    "save_quantized",
    "ExplainReport",
    "ALL_LAYOUTS",
    "FallbackWarning",
    "Int4WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Int8StaticActivationInt8WeightConfig",
    "int8_static_activation_int8_weight",
    "Int8WeightOnlyConfig",
    "IntxWeightOnlyConfig",
    "LLMInt8Config",
    "NF4WeightOnlyConfig",
    "Layout",
    "LayerNotSupported",
    "LinearKernel",
    "MappingType",
    "NoKernelError",
    "OutlierInt8",
    "PerBlockInt8",
    "PerTokenInt8",
    "StaticInt8",
    "PlainForm",
    "QuantConfig",
    "QuantSpec",
    "QuantizationError",
    "SkippedLayerWarning",
    "TiedWeightWarning",
    "TensorImpl",
    "ZeroPointDomain",
    "choose_layout",
    "config_from_json",
    "config_from_name",
    "explain",
    "int4_weight_only",
    "int8_dynamic_activation_int8_weight",
    "int8_weight_only",
    "intx_weight_only",
    "llm_int8",
    "Int8DynamicActivation4BitWeightConfig",
    "int8_dynamic_activation_4bit_weight",
    "nf4_weight_only",
    "fp4_weight_only",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8WeightOnlyConfig",
    "float8_dynamic_activation_float8_weight",
    "float8_weight_only",
    "Float8Activations",
    "is_strict",
    "layout_from_json",
    "blockwise",
    "distributed",
    "interop",
    "native",
    "layouts",
    "linear_kernels",
    "primitives",
    "quantize_",
    "register_linear_kernel",
    "set_strict",
    "strict",
    "unregister_linear_kernel",
]
for _name in layouts.__all__:
    if _name.endswith("Layout") and _name != "Layout":
        globals()[_name] = getattr(layouts, _name)
        __all__.append(_name)
