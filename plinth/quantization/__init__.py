"""Quantization methods and their GEMM kernels.

- :mod:`~plinth.quantization.interface`: the :class:`QuantizationMethod` contract;
- :mod:`~plinth.quantization.resolve`: which method a model runs with (``--quantization``, the
  checkpoint's ``quantization_config``);
- :mod:`~plinth.quantization.selection`: choosing a method's GEMM kernel at startup;
- :mod:`~plinth.quantization.formats`, :mod:`~plinth.quantization.params`,
  :mod:`~plinth.quantization.packing`: canonical weight formats, packed checkpoint parameters, bit packing;
- one module per in-tree method (``fp8``, ``int4``, ``awq``, ``gptq``, ``compressed_tensors``, ``gguf``),
  registered by :mod:`~plinth.quantization.builtin`; kernels in :mod:`plinth.quantization.kernels`.
"""
