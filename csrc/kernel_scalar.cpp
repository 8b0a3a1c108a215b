// Scalar path: portable C++, no instruction-set flags.
#include <cstdint>

#include "adam_span.h"

namespace twinflow {
namespace scalar {
#include "vec_scalar.h"
#include "adam_kernel.h"

void run_span(const AdamSpan& span, int64_t begin, int64_t end, Body body) {
  run_span_impl<VecScalar>(span, begin, end, body);
}
}  // namespace scalar
}  // namespace twinflow
