"""Device kernels shared by the model layers (fused element-wise ops, skinny GEMMs)."""
