// AVX2 path. Everything below the pragma is compiled for AVX2 + FMA + F16C and
// lives in its own namespace; the dispatcher calls it only on CPUs that have them.
#include <immintrin.h>

#include <cstdint>

#include "adam_span.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
// No contraction of a * b + c into FMA behind our back: the kernel fuses exactly
// where it calls fmadd, in its vector lanes and its scalar tail alike.
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

namespace twinflow {
namespace avx2 {
#include "vec_scalar.h"
#include "vec_avx2.h"
#include "adam_kernel.h"
#include "adam_q8.h"

void run_span(const AdamSpan& span, int64_t begin, int64_t end, Body body) {
  run_span_impl<VecAvx2>(span, begin, end, body);
}

void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end) { run_q8_impl<VecAvx2>(span, begin, end); }
}  // namespace avx2
}  // namespace twinflow

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
