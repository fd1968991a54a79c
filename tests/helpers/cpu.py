"""CPU capability facts the tests simulate."""

# torch's message on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (e.g. an AVX2-only AMD EPYC)
BF16_ERROR = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl "
              "and avx512dq")
