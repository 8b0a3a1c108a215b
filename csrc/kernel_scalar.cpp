// Scalar path: portable C++, no instruction-set flags.
#include <xmmintrin.h>

#include <cstdint>

#include "adam_span.h"

// No contraction of a * b + c into FMA (with -march=native, say): the scalar
// path multiplies and adds with two roundings whatever the compiler flags.
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace twinflow {
namespace scalar {
#include "vec_scalar.h"
#include "adam_kernel.h"
#include "adam_q8.h"

void run_span(const AdamSpan& span, int64_t begin, int64_t end, Body body) {
  run_span_impl<VecScalar>(span, begin, end, body);
}

void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end) { run_q8_impl<VecScalar>(span, begin, end); }
}  // namespace scalar
}  // namespace twinflow

#if !defined(__clang__)
#pragma GCC pop_options
#endif
