"""Building blocks below the MoE layer: parameter sharding and init, tensor-parallel layers, fused kernels."""
