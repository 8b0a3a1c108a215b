// Scalar path: portable C++, no instruction-set flags.
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

void run_span(const AdamSpan& span, int64_t begin, int64_t end, Body body) {
  run_span_impl<VecScalar>(span, begin, end, body);
}
}  // namespace scalar
}  // namespace twinflow

#if !defined(__clang__)
#pragma GCC pop_options
#endif
