"""Optimizers with quantized states: :class:`AdamW8bit` (bitsandbytes' blockwise 8-bit states,
2.03 bytes per parameter) and :class:`AdamW4bit` (4-bit states, 1.06 bytes per parameter),
drop-ins for :class:`torch.optim.AdamW` (docs/optim.md). Formats: :mod:`torchq.optim.formats`;
the update and its reference: :mod:`torchq.optim.adamw`; the fused CPU kernel: :mod:`torchq.optim.native`.
"""

from .adamw import AdamW4bit, AdamW8bit, QuantizedAdamW
from .formats import FORMAT_4BIT, FORMAT_8BIT, StateFormat

__all__ = ["AdamW8bit", "AdamW4bit", "QuantizedAdamW", "StateFormat", "FORMAT_8BIT", "FORMAT_4BIT"]
