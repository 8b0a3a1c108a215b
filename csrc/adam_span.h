// Plain data shared by the dispatcher and the per-ISA kernels. No functions
// live here: each ISA translation unit compiles its own code under its own
// target flags, so nothing built for AVX-512 can leak into the scalar path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace twinflow {

// Storage types of a gradient or of the optional low-precision weight copy.
enum class Dtype : int32_t { kNone = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// 16-bit storage, distinct types so the kernel picks the conversion by overload.
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};
// Tag for "no low-precision copy requested".
struct no_out_t {};

// Streaming (non-temporal) stores for the low-precision copy. Off with
// -DTWINFLOW_NO_STREAMING_STORES (TWINFLOW_EXTRA_CFLAGS), to compare.
#if defined(TWINFLOW_NO_STREAMING_STORES)
constexpr bool kStreamingStores = false;
#else
constexpr bool kStreamingStores = true;
#endif

// Per-tensor constants, derived once per call from lr/betas/step.
struct AdamConsts {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float step_size;     // lr / bias_correction1
  float inv_bc2_sqrt;  // 1 / sqrt(bias_correction2)
  float grad_scale;    // grad *= grad_scale first (clipping or loss-scale coefficient); 1 = off
  float l2_decay;      // Adam (L2) mode: grad += l2_decay * param
  float param_scale;   // AdamW mode: param *= param_scale (1 - lr * wd)
};

// One contiguous run of elements of one tensor. The state is read from the
// *_in pointers and written to param/exp_avg/exp_avg_sq: the same memory for
// an update in place, other memory for one out of place (a speculative step,
// which leaves the state it started from untouched for a rollback).
struct AdamSpan {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  const float* param_in;
  const float* exp_avg_in;
  const float* exp_avg_sq_in;
  void* out;  // low-precision copy of the updated param, or nullptr
  int64_t numel;
  Dtype grad_dtype;
  Dtype out_dtype;  // kNone when out is nullptr
  const AdamConsts* consts;
};

// Which kernel body runs: the Adam update, or a bandwidth probe that moves
// the same bytes with trivial arithmetic (to measure the memory ceiling).
// kPeek: the update's arithmetic, but only the low-precision copy is written
// (the new weights first; the state is committed by a later kAdam pass with
// the same arithmetic, so the committed master is the one the copy rounds);
// kPeekProbe: the peek's bytes with trivial arithmetic.
enum class Body : int32_t { kAdam = 0, kProbe = 1, kPeek = 2, kPeekProbe = 3 };

// 8-bit moments (state_precision="int8"): per block of kQ8Block elements of a
// tensor, exp_avg as int8 codes and exp_avg_sq as uint8 codes, each a small
// float relative to a power-of-two block scale kept as one byte (its float32
// exponent field; adam_q8.h has the format), stochastically rounded so that
// moments that move by less than a code step per step still move on average.
constexpr int64_t kQ8Block = 256;

struct Q8Span {
  float* param;  // nullptr when the master is kept in 24 bits (master_hi, master_lo)
  const void* grad;
  int8_t* m_codes;
  uint8_t* m_scales;  // one per block: the float32 exponent field of its scale
  uint8_t* v_codes;
  uint8_t* v_scales;
  void* out;
  int64_t numel;
  uint32_t index_base;  // the tensor's first element's index in its parameter (the rounding noise's input)
  uint32_t step;
  Dtype grad_dtype;
  Dtype out_dtype;
  const AdamConsts* consts;
  Body body;
  // state_precision "int8_m24": the float32 master's top 16 bits (a bfloat16) and its next 8, stochastically
  // rounded to them at every step (adam_q8.h); both nullptr when `param` holds float32 masters.
  bf16_t* master_hi;
  uint8_t* master_lo;
};

// One entry point per instruction set, each in its own translation unit.
// Processes elements [begin, end) of the span.
// run_q8_blocks: blocks [begin, end) of an 8-bit span.
namespace avx512 {
void run_span(const AdamSpan& span, int64_t begin, int64_t end, Body body);
void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end);
}  // namespace avx512
namespace avx2 {
void run_span(const AdamSpan& span, int64_t begin, int64_t end, Body body);
void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end);
}  // namespace avx2
namespace scalar {
void run_span(const AdamSpan& span, int64_t begin, int64_t end, Body body);
void run_q8_blocks(const Q8Span& span, int64_t begin, int64_t end);
}  // namespace scalar

}  // namespace twinflow
