"""torchq's quantization method for vLLM: ``quant_method: "torchq"`` checkpoints served as saved.

:class:`TorchqVllmConfig` is the quantization config vLLM builds from ``config.json``'s
``quantization_config`` (what :class:`torchq.hf.TorchqConfig` writes). It opens the folder's torchq
header before vLLM builds the model and checks every stored tensor (:mod:`torchq.vllm.folder`), then
gives each vLLM linear layer whose checkpoint weights are quantized a :class:`TorchqLinearMethod`;
layers the checkpoint keeps in float get vLLM's own ``UnquantizedLinearMethod`` (as
:class:`TorchqFloatLinearMethod`, which checks their biases after loading).

:class:`TorchqLinearMethod` follows vLLM's contract for a linear method:

* ``create_weights`` allocates the rank's shard of each part of the stored record
  (:func:`torchq.vllm.weights.plan_shard`) as parameters ``tq_codes``, ``tq_scale``, ... with
  vLLM's ``output_dim`` / ``input_dim`` attributes;
* vLLM's loader reads the checkpoint, renames ``<weight>:<part>`` keys to those parameters
  (:meth:`TorchqVllmConfig.get_checkpoint_weight_mapper`) and calls their ``weight_loader``,
  which checks the part's dtype, shape and CRC-32 against the record, then lets the layer's own
  loader cut and copy the rank's rows or columns (fused ``q/k/v`` and ``gate/up`` weights land
  in their row ranges);
* ``process_weights_after_loading`` checks that every part of every fused weight arrived (and
  every part of the layer's bias, where it has one) and packs them
  into the device's layout as an ``AffineQuantizedTensor`` (``layer.weight``);
* ``apply`` is ``F.linear`` on it: torchq's dispatch picks the kernel, exactly as in a
  transformers model quantized by torchq (through :class:`torchq.dispatch.DirectLinear`, which
  calls the kernel's cached per-call form directly once an input shape has run).

Tensor-parallel row-parallel layers need each rank's input features to be whole groups (and a
multiple of 8 for sub-byte codes); weights whose input features cannot be cut that way are
refused with an error naming the layer and the sizes. A quantized LM head gets a
:class:`TorchqEmbeddingMethod` (vLLM's logits call its ``apply``); tied to the token embedding, it
is that embedding's weight too (``embedding`` looks rows up, dequantizing only those).
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import WeightsMapper
from vllm.model_executor.utils import set_weight_attrs

from ..checkpoint.codec import CheckpointError, ParsedRecord, check_version, tensor_crc32
from ..checkpoint.safetensors_io import FILE_FORMAT, FILE_VERSION
from ..dispatch import DirectLinear
from ..layouts import Layout, layout_from_json
from .folder import ServedCheckpoint, local_folder
from .weights import ShardPlan, build_weight, nested_scale, plan_shard, whole_offsets

__all__ = ["QUANT_METHOD", "TorchqVllmConfig", "TorchqLinearMethod", "TorchqFloatLinearMethod", "TorchqEmbeddingMethod"]

try:  # vLLM picks a linear method's weight loader by its class name
    from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method as _weight_loader_v2
except ImportError:  # pragma: no cover - older vLLM: the v1 loader

    def _weight_loader_v2(cls: type) -> type:
        return cls


QUANT_METHOD = "torchq"
PARAM_PREFIX = "tq_"
_PART_KEY = re.compile(r"\.weight:(codes|scale|zero_point|scale_codes|scale_absmax|scale_offset|input_scale|input_perm)$")


@functools.cache
def allow_amx_on_cpu() -> bool:
    """Ask Linux, once per process, for the AMX tile state (``torch.cpu._init_amx``: arch_prctl
    ``ARCH_REQ_XCOMP_PERM``) on CPUs that have AMX; returns whether this process may run AMX.

    vLLM's CPU attention and other kernels of its own run AMX instructions whenever the CPU has
    them, but a process gets the permission only by asking. oneDNN asks the first time it runs an
    AMX GEMM, which vLLM's float linears do; a model whose every linear is a torchq kernel (int8
    dynamic, int4a8, a quantized LM head) never runs one, and its first bf16 attention call died
    with SIGILL. Where the permission is refused, warn: vLLM's AMX kernels will fail."""
    cpu = getattr(torch, "cpu", None)
    if not getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return False
    if cpu._init_amx():
        return True
    warnings.warn("torchq.vllm: this CPU has AMX but Linux refused this process the AMX tile state "
                  "(arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's AMX kernels (its bf16 CPU attention) will fail "
                  "with an illegal instruction", RuntimeWarning, stacklevel=2)
    return False


class TorchqVllmConfig(QuantizationConfig):
    """vLLM's quantization config for a torchq checkpoint (``quant_method: "torchq"``).

    ``config``: ``config.json``'s ``quantization_config``. Its ``layout`` is the layout policy
    (``"auto"``: the layout the device prefers, ``"saved"``: the stored one where it can live here,
    or a layout's JSON); which weights are quantized, and how, is read from the checkpoint's own
    torchq header (``quant`` and ``modules_to_not_convert`` record how it was made)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if not isinstance(config, dict):
            raise CheckpointError(f"quantization_config: expected a JSON object, got {type(config).__name__}")
        fmt = config.get("format", FILE_FORMAT)
        if fmt != FILE_FORMAT:
            raise CheckpointError(f"quantization_config: format {fmt!r} is not {FILE_FORMAT!r}")
        check_version(config.get("version", FILE_VERSION), FILE_VERSION, "quantization_config: format")
        layout = config.get("layout", "auto")
        if isinstance(layout, dict):
            try:
                layout = layout_from_json(layout)
            except (TypeError, ValueError, KeyError) as e:
                raise CheckpointError(f"quantization_config: layout {layout!r}: {e}") from None
        if not (isinstance(layout, Layout) or layout in ("auto", "saved")):
            raise CheckpointError(f"quantization_config: layout must be 'auto', 'saved' or a layout's JSON, got {layout!r}")
        self.layout: str | Layout = layout
        self.checkpoint: ServedCheckpoint | None = None
        self.renames: WeightsMapper | None = None
        self._index: dict[str, str] | None = None  # vLLM name -> stored name, built on first use
        self.tied: bool | None = None  # the model config's tie_word_embeddings (None: not known)

    def __repr__(self) -> str:
        where = None if self.checkpoint is None else str(self.checkpoint.path)
        return f"TorchqVllmConfig(layout={self.layout!r}, checkpoint={where!r})"

    def get_name(self) -> str:  # type: ignore[override]
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TorchqVllmConfig:
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """Open and check the checkpoint (vLLM calls this in its front process, with the model's
        folder or Hub id, before any worker starts)."""
        self.checkpoint = ServedCheckpoint(local_folder(model_name, revision))
        # tied where the text config or the top-level one says so (vLLM's transformers backend
        # reads both; a multimodal config's text config may say False under a True top level)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        said = [getattr(c, "tie_word_embeddings", None) for c in (hf_config, text)]
        self.tied = True if True in said else False if False in said else None

    def apply_vllm_mapper(self, hf_to_vllm_mapper: WeightsMapper) -> None:
        self.renames = hf_to_vllm_mapper

    def get_checkpoint_weight_mapper(self) -> WeightsMapper:
        """``<weight>:<part>`` keys load into the layer's ``tq_<part>`` parameters."""
        return super().get_checkpoint_weight_mapper() | WeightsMapper(orig_to_new_regex={_PART_KEY: rf".{PARAM_PREFIX}\1"})

    # -- which layers are quantized ------------------------------------------------------------
    def _stored_name(self, vllm_name: str) -> str:
        """The checkpoint's name of the weight vLLM calls ``vllm_name``."""
        ckpt = self._checked()
        if self.renames is None or ckpt.holds(vllm_name):
            return vllm_name
        if self._index is None:
            self._index = {}
            for name in [*ckpt.records, *ckpt.floats, *ckpt.aliases]:
                mapped = self.renames.map_name(name)
                if mapped is not None:
                    self._index.setdefault(mapped, name)
        return self._index.get(vllm_name, vllm_name)

    def _checked(self) -> ServedCheckpoint:
        if self.checkpoint is None:
            raise CheckpointError("torchq's vLLM config has not read its checkpoint (vLLM did not call maybe_update_config)")
        return self.checkpoint

    def fused_names(self, prefix: str, param: str = "weight") -> list[str]:
        """The checkpoint's ``param`` tensors (``weight`` or ``bias``) of vLLM layer ``prefix``: its
        own, or those vLLM fuses into it."""
        parent, _, last = prefix.rpartition(".")
        subs = self.packed_modules_mapping.get(last)
        if not subs:
            return [self._stored_name(f"{prefix}.{param}")]
        return [self._stored_name(f"{parent}.{s}.{param}" if parent else f"{s}.{param}") for s in subs]

    def check_bias(self, layer: torch.nn.Module, prefix: str) -> None:
        """After loading: a layer vLLM built with a bias got every fused part of it from the
        checkpoint (:func:`record_bias_loads` saw them arrive). With a quantization method vLLM does
        not check for missing tensors (and without one, it counts a fused bias loaded once any part
        is), so a missing part would serve the memory ``torch.empty`` left."""
        if getattr(layer, "bias", None) is None:
            return
        loads = layer.__dict__.get(_BIAS_LOADS)
        if loads is None or None in loads:  # not recorded, or loaded whole
            return
        parts = _bias_parts(layer)
        missing = [p for p in parts if p not in loads] if parts else [] if loads else [None]
        if missing:
            names = self.fused_names(prefix, "bias")
            if parts and len(names) == len(parts):
                names = [names[parts.index(p)] for p in missing]
            raise CheckpointError(
                f"{self._checked().path}: vLLM layer {prefix!r} has a bias, but vLLM loaded none for {names} from the "
                f"checkpoint (with a quantization method vLLM does not check for missing tensors: the layer would "
                f"add uninitialized memory)")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        ckpt = self._checked()
        if isinstance(layer, VocabParallelEmbedding):  # the token embedding, or the LM head (ParallelLMHead)
            name = self._stored_name(f"{prefix}.weight")
            record = ckpt.record(name)
            # vLLM builds some models' embedding without a name (Llama's); a head vLLM ties to the
            # embedding is not loaded; any other embedding the checkpoint does not store under its
            # own name (an alias is no tensor vLLM loads) would serve uninitialized memory (vLLM
            # checks for missing weights only without a quantization method)
            if prefix and not ckpt.stores(name) and not (isinstance(layer, ParallelLMHead) and self.tied is not False):
                alias = f" (only as an alias of {ckpt.aliases[name]!r}: vLLM loads stored tensors)" if name in ckpt.aliases else ""
                raise CheckpointError(f"{ckpt.path}: the checkpoint stores no {name!r} for vLLM layer {prefix!r}{alias}")
            return None if record is None else TorchqEmbeddingMethod(self, prefix, [name], [record])
        if not isinstance(layer, LinearBase):
            return None
        names = self.fused_names(prefix)
        records = [ckpt.record(n) for n in names]
        missing = [n for n in names if not ckpt.holds(n)]
        if missing:
            raise CheckpointError(f"{ckpt.path}: the checkpoint has no {missing} for vLLM layer {prefix!r}")
        aliased = [n for n in names if not ckpt.stores(n)]
        if aliased:
            raise CheckpointError(
                f"{ckpt.path}: vLLM layer {prefix!r}: {aliased} are stored only as aliases of "
                f"{[ckpt.aliases[n] for n in aliased]}; vLLM loads a linear layer's weights from tensors stored under "
                f"their own names (save the model with the weights untied)"
            )
        if all(r is None for r in records):
            return TorchqFloatLinearMethod(self, prefix)
        if any(r is None for r in records):
            floats = [n for n, r in zip(names, records) if r is None]
            raise CheckpointError(
                f"{ckpt.path}: vLLM fuses {names} into layer {prefix!r}, but {floats} are stored in float and the rest "
                f"quantized; quantize all of them or none (modules_to_not_convert)"
            )
        return TorchqLinearMethod(self, prefix, names, records)  # type: ignore[arg-type]


class TorchqLinearMethod(LinearMethodBase):
    """A vLLM linear layer whose checkpoint weights are torchq-quantized (see the module doc)."""

    def __init__(self, config: TorchqVllmConfig, prefix: str, names: list[str], records: list[ParsedRecord]) -> None:
        self.config = config
        self.prefix = prefix
        self.names = names
        self.records = records
        self.direct = DirectLinear()  # apply's calls, past each input shape's first

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        if len(output_partition_sizes) != len(self.names):
            raise CheckpointError(f"vLLM layer {self.prefix!r}: {len(output_partition_sizes)} fused outputs, but the "
                                  f"checkpoint weights {self.names}")
        tp_rank = getattr(layer, "tp_rank", 0) if input_size_per_partition != input_size else 0
        plan = plan_shard(self.prefix, self.names, self.records, output_partition_sizes, input_size,
                          input_size_per_partition, tp_rank * input_size_per_partition, _model_rows(layer, output_size))
        layer_loader = extra_weight_attrs.pop("weight_loader")
        from vllm.model_executor.layers.linear import QKVParallelLinear

        shard_ids: list[Any] = ([None] if len(self.names) == 1 else ["q", "k", "v"] if isinstance(layer, QKVParallelLinear)
                                else list(range(len(self.names))))
        state = _LayerState(plan, params_dtype, layer_loader, shard_ids)
        for part in plan.parts:
            param = Parameter(torch.zeros(part.shape, dtype=part.dtype), requires_grad=False)
            attrs: dict[str, Any] = {"tq_part": part.name, "weight_loader": state.loader}
            if part.output_dim is not None:
                attrs["output_dim"] = part.output_dim
            if part.input_dim is not None:
                attrs["input_dim"] = part.input_dim
            set_weight_attrs(param, attrs)
            set_weight_attrs(param, extra_weight_attrs)
            layer.register_parameter(PARAM_PREFIX + part.name, param)
        layer.torchq_state = state
        if isinstance(layer, LinearBase):
            record_bias_loads(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.config.check_bias(layer, self.prefix)
        state: _LayerState = layer.torchq_state
        plan = state.plan
        if state.weight is None:
            state.weight = Parameter(self._build(layer, state), requires_grad=False)
        if state.weight.device.type == "cpu":
            allow_amx_on_cpu()
        for p in plan.parts:  # a tied LM head shares these parameters (and the weight) with the embedding
            delattr(layer, PARAM_PREFIX + p.name)
        del layer.torchq_state
        layer.weight = state.weight

    def _build(self, layer: torch.nn.Module, state: _LayerState):
        plan = state.plan
        absent = [(plan.names[i], p.name) for p in plan.parts if p.name != "scale" or not plan.record.spec.double_quant
                  for i in range(len(plan.names)) if (p.name, i) not in state.loaded]
        if absent:
            raise CheckpointError(f"vLLM layer {self.prefix!r}: the checkpoint files did not provide {absent}")
        params = {p.name: getattr(layer, PARAM_PREFIX + p.name).data for p in plan.parts}
        if plan.record.spec.double_quant:  # the fp32 scales, cut by the layer's own loader like any part
            scale_param = getattr(layer, PARAM_PREFIX + "scale")
            for i in range(len(plan.names)):
                state.load_cut(scale_param, nested_scale(plan, params, i), i)
        return build_weight(plan, params, self.prefix, state.dtype, self.config.layout)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.direct(x, layer.weight, bias)


@_weight_loader_v2
class TorchqFloatLinearMethod(UnquantizedLinearMethod):
    """vLLM's own method for a linear layer the checkpoint keeps in float (its weight loader too),
    with the bias check (:meth:`TorchqVllmConfig.check_bias`) after loading."""

    def __init__(self, config: TorchqVllmConfig, prefix: str) -> None:
        super().__init__()
        self.config = config
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().create_weights(layer, *args, **kwargs)
        record_bias_loads(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.config.check_bias(layer, self.prefix)
        super().process_weights_after_loading(layer)


class TorchqEmbeddingMethod(TorchqLinearMethod):
    """A token embedding or LM head whose checkpoint weight is torchq-quantized: the rank's rows of
    the vocabulary (vLLM's loader cuts them and zero-fills the padding rows, which dequantize to
    0), looked up by ``embedding`` (only the selected rows are dequantized) and multiplied by
    ``apply`` for the logits. A tied LM head shares the embedding's parameters and weight."""

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight)

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        if getattr(embed_tokens, "torchq_state", None) is None:
            # vLLM builds some models' embedding without a name (Llama's), so it got vLLM's float method:
            # it becomes this quantized weight's embedding, sharing the head's parameters
            shapes = [(getattr(m, "num_embeddings_per_partition", None), getattr(m, "embedding_dim", None))
                      for m in (layer, embed_tokens)]
            if shapes[0] != shapes[1]:
                raise CheckpointError(f"vLLM layer {self.prefix!r}: tied to an embedding of another shape ({shapes})")
            if "weight" in embed_tokens._parameters:
                delattr(embed_tokens, "weight")
            for part in layer.torchq_state.plan.parts:
                embed_tokens.register_parameter(PARAM_PREFIX + part.name, getattr(layer, PARAM_PREFIX + part.name))
            embed_tokens.torchq_state = layer.torchq_state
            embed_tokens.quant_method = self
            return layer
        for part in layer.torchq_state.plan.parts:
            delattr(layer, PARAM_PREFIX + part.name)
            layer.register_parameter(PARAM_PREFIX + part.name, getattr(embed_tokens, PARAM_PREFIX + part.name))
        layer.torchq_state = embed_tokens.torchq_state
        return layer


_BIAS_LOADS = "torchq_bias_loads"


def record_bias_loads(layer: torch.nn.Module) -> None:
    """Make ``layer`` record which parts of its bias vLLM loads: vLLM creates a linear layer's bias
    after ``create_weights`` and gives it the layer's own ``weight_loader``, called once per fused
    part (``"q"``, ``"k"``, ``"v"``; 0, 1, ...) or once for the whole bias (None). That loader is
    wrapped here, for this layer only; what arrived is kept for
    :meth:`TorchqVllmConfig.check_bias`. A part vLLM makes up (Whisper's zero ``k_proj`` bias)
    arrives through it too."""
    loader = layer.weight_loader
    loads: set[Any] = set()

    def weight_loader(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if param is getattr(layer, "bias", None):
            part = args[0] if args else kwargs.get("loaded_shard_id")
            loads.update(part if isinstance(part, tuple) else (part,))
        return loader(param, loaded_weight, *args, **kwargs)

    layer.weight_loader = weight_loader
    layer.__dict__[_BIAS_LOADS] = loads


def _bias_parts(layer: torch.nn.Module) -> list[Any]:
    """The parts vLLM loads a fused layer's bias in, for its plain fused classes; [] for others
    (one load, whole, or parts this module does not know)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if type(layer) is QKVParallelLinear:
        return ["q", "k", "v"]
    if type(layer) is MergedColumnParallelLinear:
        return list(range(len(layer.output_sizes)))
    return []


def _model_rows(layer: torch.nn.Module, output_size: int) -> list[int] | None:
    """The rows of each checkpoint weight of ``layer`` on all ranks, as the model's config gives
    them: the vocabulary (without padding) of an embedding or LM head, each of q / k / v (the kv
    heads counted once, however many ranks replicate them), each fused weight of a merged layer,
    the output size of the other plain layers. None (not checked) for vLLM's subclasses of these,
    whose sizes may count a replicated piece once per rank."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    kind = type(layer)
    if kind in (VocabParallelEmbedding, ParallelLMHead):
        return [layer.org_vocab_size]
    if kind is QKVParallelLinear:
        kv = layer.total_num_kv_heads
        return [layer.total_num_heads * layer.head_size, kv * layer.head_size, kv * layer.v_head_size]
    if kind is MergedColumnParallelLinear:
        return list(layer.output_sizes)
    if kind in (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear):
        return [output_size]
    return None


class _LayerState:
    """Loading state of one layer: its plan, model dtype, its own vLLM weight loader, and which
    (part, fused weight) pairs have been loaded."""

    def __init__(self, plan: ShardPlan, dtype: torch.dtype, layer_loader: Any, shard_ids: list[Any]) -> None:
        self.plan = plan
        self.dtype = dtype
        self.layer_loader = layer_loader
        self.shard_ids = shard_ids
        self.loaded: set[tuple[str, int]] = set()
        self.weight: Parameter | None = None  # the packed weight, once built

    def index(self, shard_id: Any) -> int:
        if shard_id not in self.shard_ids:
            raise CheckpointError(f"vLLM layer: unexpected shard id {shard_id!r} for {list(self.plan.names)} "
                                  f"(expected one of {self.shard_ids})")
        return self.shard_ids.index(shard_id)

    def load_cut(self, param: Parameter, full: torch.Tensor, index: int) -> None:
        """The layer's own loader: it cuts this rank's rows / columns of ``full`` into ``param``."""
        shard_id = self.shard_ids[index]
        if shard_id is None:
            self.layer_loader(param, full)
        else:
            self.layer_loader(param, full, shard_id)

    def loader(self, param: Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """vLLM's loader hands over one stored part of one checkpoint weight (whole)."""
        part = param.tq_part
        i = self.index(shard_id)
        name, rec = self.plan.names[i], self.plan.records[i]
        where = f"quantized tensor {name!r}: part {part!r}"
        if part not in rec.parts:
            raise CheckpointError(f"{where}: its record has no such part (parts {sorted(rec.parts)})")
        dtype, shape, crc = rec.parts[part]
        if loaded.dtype != dtype or tuple(loaded.shape) != shape:
            raise CheckpointError(f"{where}: the file holds {loaded.dtype} {list(loaded.shape)}, its record says "
                                  f"{dtype} {list(shape)}")
        if crc is None or tensor_crc32(loaded) != crc:
            raise CheckpointError(f"{where}: corrupted (crc32 mismatch)")
        plan_part = self.plan.part(part)
        if plan_part is not None and plan_part.whole:
            start, n = whole_offsets(self.plan, part)[i]
            param.data[start:start + n].copy_(loaded.reshape(-1))
        else:
            self.load_cut(param, loaded, i)
        self.loaded.add((part, i))

