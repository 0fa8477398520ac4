"""GEMM kernels of quantized linear layers, each a selectable candidate (see ``kernels.interface``)."""
