"""FP8 matrix products: ``jaxamp.fp8``'s settings, which products run in FP8, the scaled GEMM."""
