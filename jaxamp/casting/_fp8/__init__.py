"""FP8 matrix products: ``jaxamp.fp8``'s settings, which run in FP8, the scaled GEMM, its health."""
