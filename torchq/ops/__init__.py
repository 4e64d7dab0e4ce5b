"""Every ``torchq::`` op: its schema, fake implementation, argument checks and pure-PyTorch
reference (the executable spec), one module per op family. Device backends
(:mod:`torchq.backends`) register implementations against these ops; where a backend is missing
(no native library, no triton) the op runs its reference, or the layout's kernel list rejects the
input with the reason (``torchq.explain``).

The ops, the module defining each and the device implementations registered besides the
reference ("aten": the op is defined by an aten op on every device; ``tests/test_ops_registry.py``
checks this table against the registrations):

=========================  ===========  ==========================================
op                         module       implementations
=========================  ===========  ==========================================
choose_qparams_affine      affine       reference only
quantize_affine            affine       reference only
dequantize_affine          affine       reference only
int8_weight_linear         int8         cpu: native_cpu; cuda: triton
int8_dynamic_linear        int8         cpu: native_cpu; cuda: triton
int8_static_linear         int8         cpu: native_cpu; cuda: triton
int8_weight_only_mm        int8         aten (aten._weight_int8pack_mm)
int8_panel_weight_linear   int8_panels  cpu: native_cpu
int8_panel_dynamic_linear  int8_panels  cpu: native_cpu
int8_panel_static_linear   int8_panels  cpu: native_cpu
int4_groupwise_linear      int4         cpu: native_cpu; cuda: triton
int4_cpu_mm                int4         aten (aten._weight_int4pack_mm_for_cpu)
int4_tensor_core_mm        int4         cuda: aten (triton from 32 rows)
int4_xpu_mm                int4         xpu: aten
blockwise_4bit_linear      blockwise    cpu: native_cpu; cuda: triton
int4_groupwise_linear_a8   int8act      cpu: native_cpu; cuda: triton
blockwise_4bit_linear_a8   int8act      cpu: native_cpu; cuda: triton
quantize_4bit              blockwise    reference only
dequantize_4bit            blockwise    reference only
dequantize_4bit.out        blockwise    reference only
quantize_blockwise         blockwise    reference only
dequantize_blockwise       blockwise    reference only
dequantize_blockwise.out   blockwise    reference only
gemv_4bit                  blockwise    cpu: native_cpu
gemv_4bit.out              blockwise    the functional op's
gemm_4bit                  blockwise    cpu: native_cpu
int8_vectorwise_quant      vectorwise   reference only
int8_vectorwise_dequant    vectorwise   reference only
int8_double_quant          vectorwise   reference only
int8_linear_matmul         vectorwise   reference only (torch._int_mm)
int8_linear_matmul.out     vectorwise   reference only
int8_mm_dequant            vectorwise   reference only
int8_scaled_mm             vectorwise   reference only
int8_linear_dequant        vectorwise   reference only (alias of int8_scaled_mm)
int8_mixed_scaled_mm       vectorwise   reference only
float8_dynamic_linear      float8       cuda: aten (torch._scaled_mm)
float8_weight_linear       float8       cuda: triton
=========================  ===========  ==========================================

:mod:`.out_overloads` defines the ``.out`` overloads (kernel and fake run the functional op).
"""

from . import affine, blockwise, float8, int4, int8, int8_panels, int8act, vectorwise

__all__ = ["affine", "blockwise", "float8", "int4", "int8", "int8_panels", "int8act", "vectorwise"]
