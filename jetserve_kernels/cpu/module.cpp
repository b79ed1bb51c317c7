// Python bindings of the CPU kernels (see ops.h).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged fp32, bf16 or int8 KV cache (invariant: in the order "
        "paged_prefill_attention keeps)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "a prefill slice's causal attention over a paged fp32, bf16 or int8 KV cache "
        "(invariant: over a bf16 cache in the products the invariant decode takes)");
  m.def("paged_prefill_as_decodes", &paged_prefill_as_decodes,
        "a prefill slice's tokens, each with the bits the invariant paged_decode_attention "
        "gives it alone");
  m.def("prefill_attention_kernel", &prefill_attention_kernel,
        "whether paged_prefill_attention is built in (AVX-512)");
  m.def("linear_f32", &linear_f32, "x W^T, W fp32 packed in panels of 32 output columns");
  m.def("linear_bf16", &linear_bf16, "x W^T, W bf16 packed in panels of 32 output columns");
  m.def("linear_bf16_pairs", &linear_bf16_pairs,
        "x W^T in bf16 dot products at every row count, W bf16 pairs [N / 32, K / 2, 32, 2], on "
        "units avx512 (vdpbf16ps), amx (AMX tiles) or amx_model (a software model of the "
        "tiles)");
  m.def("linear_int8", &linear_int8, "x W^T, W int8 panels with a scale per 32 weights");
  m.def("linear_int4", &linear_int4, "x W^T, W int4 panels with a scale and min per 32 weights");
  m.def("bf16_dot_products", &bf16_dot_products, "whether many_rows=\"bf16\" is built in");
  m.def("amx_bf16", &amx_bf16, "whether linear_bf16_pairs can run on AMX tiles here");
  m.def("amx_int8", &amx_int8,
        "whether linear_w8a8 / linear_w4a8 can run on AMX-INT8 tiles here (many_rows amx_int8)");
  m.def("linear_w8a8", &linear_w8a8, "x W^T, W int8 quads, x quantized to 8 (or 16) bits per 32");
  m.def("linear_w4a8", &linear_w4a8, "x W^T, W int4 quads, x quantized to 8 (or 16) bits per 32");
  m.def("int8_dot_products", &int8_dot_products, "whether linear_w8a8 / linear_w4a8 are built in");
  m.def("dot_peak_flops", &dot_peak_flops,
        "flops a second of fp32 FMAs, bf16 or int8 dot products on every intra-op thread, from "
        "registers (a benchmark's ceiling)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding x into the residual first");
  m.def("rotary_and_cache", &rotary_and_cache,
        "rotary on the q and k parts of a fused qkv row (then, given q_mul and k_mul, both into "
        "an int8 cache's key basis), then k and v into the paged cache");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
}
