"""Checkpoints: ``torch.save``/``torch.load(weights_only=True)`` support and safetensors files.

* :mod:`.codec`: one quantized weight as device-independent plain tensors + a JSON record;
* :mod:`.pickling`: how torchq objects pickle (pinned paths, allow-listed at import);
* :mod:`.model_state`: a model's state-dict entries and atomic installation of loaded tensors;
* :mod:`.safetensors_io`: :func:`save_quantized` / :func:`load_quantized`.
"""

from . import pickling
from .codec import CheckpointError
from .model_state import LoadWarning, init_meta_buffers, install_load_state_dict_guard
from .safetensors_io import load_quantized, save_quantized

pickling.register_safe_globals()
install_load_state_dict_guard()

__all__ = ["CheckpointError", "LoadWarning", "init_meta_buffers", "load_quantized", "save_quantized"]
