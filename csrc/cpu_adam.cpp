// Operator registration, argument checks, instruction-set dispatch and the one
// parallel region that walks every element of every tensor in a call.
#include <ATen/ATen.h>
#include <cpuid.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "adam_span.h"

namespace twinflow {
namespace {

enum Simd : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Best path this CPU and OS support (the builtins check OS register saving).
int64_t best_simd() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return kAvx512;
  }
  return avx2 ? kAvx2 : kScalar;
}

using RunSpanFn = void (*)(const AdamSpan&, int64_t, int64_t, Body);
using RunQ8Fn = void (*)(const Q8Span&, int64_t, int64_t);

// The entry point of the chosen instruction set (one per translation unit).
template <class Fn>
Fn for_simd(int64_t simd, Fn avx512_fn, Fn avx2_fn, Fn scalar_fn) {
  switch (simd) {
    case kAvx512:
      return avx512_fn;
    case kAvx2:
      return avx2_fn;
    default:
      return scalar_fn;
  }
}

RunQ8Fn q8_kernel_for(int64_t simd) {
  return for_simd<RunQ8Fn>(simd, avx512::run_q8_blocks, avx2::run_q8_blocks, scalar::run_q8_blocks);
}

RunSpanFn kernel_for(int64_t simd) {
  return for_simd<RunSpanFn>(simd, avx512::run_span, avx2::run_span, scalar::run_span);
}

Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return Dtype::kFloat32;
    case at::kBFloat16:
      return Dtype::kBFloat16;
    case at::kHalf:
      return Dtype::kFloat16;
    default:
      return Dtype::kNone;
  }
}

void check_tensor(const at::Tensor& t, const char* list, size_t i, const at::Tensor& param) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), list, "[", i, "] is on ", t.device(),
                    "; the CPU Adam kernel needs CPU tensors (move it with .cpu())");
  TORCH_CHECK_VALUE(t.is_contiguous(), list, "[", i, "] is not contiguous; pass .contiguous() tensors");
  TORCH_CHECK_VALUE(t.numel() == param.numel(), list, "[", i, "] has ", t.numel(), " elements but params[", i,
                    "] has ", param.numel());
}

// Validates everything before any tensor is touched, so a bad call modifies nothing.
void check_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList out_copies, at::TensorList sources, at::IntArrayRef steps, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t simd,
                at::ScalarType master_dtype = at::kFloat) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
                    "adam_step_: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length; got ", n,
                    ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", steps.size());
  TORCH_CHECK_VALUE(out_copies.empty() || out_copies.size() == n,
                    "adam_step_: out_copies must be empty or have one tensor per param; got ", out_copies.size(),
                    " for ", n, " params");
  TORCH_CHECK_VALUE(sources.empty() || sources.size() == 3 * n,
                    "adam_step_: sources must be empty (in place) or hold params, exp_avgs and exp_avg_sqs to read "
                    "from, 3 * ", n, " tensors; got ", sources.size());
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0.0, "adam_step_: lr must be a finite number >= 0, got ", lr);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "adam_step_: eps must be a finite number >= 0, got ", eps);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "adam_step_: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "adam_step_: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(std::isfinite(weight_decay) && weight_decay >= 0.0,
                    "adam_step_: weight_decay must be a finite number >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(simd >= kScalar && simd <= best_simd(), "adam_step_: simd level ", simd,
                    " is not supported by this CPU (best is ", best_simd(), ": 0 scalar, 1 avx2, 2 avx512)");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_TYPE(p.scalar_type() == master_dtype, "params[", i, "] has dtype ", p.scalar_type(),
                     master_dtype == at::kFloat
                         ? "; the kernel updates float32 master weights"
                         : "; with master_lows the params are 24-bit masters' top 16 bits: bfloat16 tensors");
    check_tensor(p, "params", i, p);
    TORCH_CHECK_TYPE(dtype_of(grads[i]) != Dtype::kNone, "grads[", i, "] has dtype ", grads[i].scalar_type(),
                     "; expected float32, bfloat16 or float16");
    check_tensor(grads[i], "grads", i, p);
    // (the 8-bit op passes its params here in their place: their dtype is the masters')
    TORCH_CHECK_TYPE(exp_avgs[i].scalar_type() == master_dtype, "exp_avgs[", i, "] has dtype ",
                     exp_avgs[i].scalar_type(), "; expected ", master_dtype);
    check_tensor(exp_avgs[i], "exp_avgs", i, p);
    TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == master_dtype, "exp_avg_sqs[", i, "] has dtype ",
                     exp_avg_sqs[i].scalar_type(), "; expected ", master_dtype);
    check_tensor(exp_avg_sqs[i], "exp_avg_sqs", i, p);
    TORCH_CHECK_VALUE(steps[i] >= 1, "steps[", i, "] must be >= 1 (the step count after this update), got ",
                      steps[i]);
    if (!out_copies.empty()) {
      const Dtype od = dtype_of(out_copies[i]);
      TORCH_CHECK_TYPE(od != Dtype::kNone, "out_copies[", i, "] has dtype ", out_copies[i].scalar_type(),
                       "; expected float32, bfloat16 or float16");
      check_tensor(out_copies[i], "out_copies", i, p);
    }
    for (size_t k = 0; k < (sources.empty() ? 0 : 3); ++k) {
      const at::Tensor& src = sources[k * n + i];
      const at::Tensor& dst = k == 0 ? p : (k == 1 ? exp_avgs[i] : exp_avg_sqs[i]);
      TORCH_CHECK_TYPE(src.scalar_type() == at::kFloat, "sources[", k * n + i, "] has dtype ", src.scalar_type(),
                       "; expected float32");
      check_tensor(src, "sources", k * n + i, p);
      // In place, or apart: a partial overlap would read elements another thread already wrote.
      const auto* a = static_cast<const char*>(src.data_ptr());
      const auto* b = static_cast<const char*>(dst.data_ptr());
      const int64_t bytes = 4 * p.numel();
      TORCH_CHECK_VALUE(a == b || a + bytes <= b || b + bytes <= a, "sources[", k * n + i,
                        "] partly overlaps the tensor it is read into; pass the same tensor or a separate one");
    }
    if (!sources.empty()) {
      const bool same = sources[i].data_ptr() == p.data_ptr();
      TORCH_CHECK_VALUE(same == (sources[n + i].data_ptr() == exp_avgs[i].data_ptr()) &&
                            same == (sources[2 * n + i].data_ptr() == exp_avg_sqs[i].data_ptr()),
                        "sources for param ", i, ": the param, exp_avg and exp_avg_sq must all be read in place "
                        "or all apart");
    }
  }
}

AdamConsts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool adamw_mode, bool bias_correction, double grad_scale) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  AdamConsts c;
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.step_size = static_cast<float>(lr / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.grad_scale = static_cast<float>(grad_scale);
  c.l2_decay = adamw_mode ? 0.0f : static_cast<float>(weight_decay);
  c.param_scale = adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  return c;
}

// Splits the concatenation of several ranges (range s is [offsets[s], offsets[s + 1])) into one contiguous slice
// per thread, each bound a multiple of `align` (the last thread takes the rest), and runs `run(s, begin, end)` on
// the parts of each slice, in one parallel region: memory streams sequentially and small ranges cost no extra
// fork/join. At most one thread per `min_per_thread` units.
template <class Run>
void run_slices(const std::vector<int64_t>& offsets, int64_t num_threads, int64_t min_per_thread, int64_t align,
                const Run& run) {
  const int64_t total = offsets.back();
  if (total == 0) return;
  const int64_t wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t threads = std::max<int64_t>(1, std::min(wanted, (total + min_per_thread - 1) / min_per_thread));

#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t t = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    auto bound = [&](int64_t k) { return std::min(total, (total * k / nt + align - 1) / align * align); };
    const int64_t lo = bound(t);
    const int64_t hi = t + 1 == nt ? total : bound(t + 1);
    if (lo < hi) {
      size_t s = std::upper_bound(offsets.begin(), offsets.end(), lo) - offsets.begin() - 1;
      for (int64_t pos = lo; pos < hi; ++s) {
        const int64_t begin = pos - offsets[s];
        const int64_t end = std::min(hi, offsets[s + 1]) - offsets[s];
        if (end > begin) run(s, begin, end);
        pos = offsets[s] + end;
      }
    }
  }
}

std::vector<AdamConsts> consts_for(at::IntArrayRef steps, double lr, double beta1, double beta2, double eps,
                                   double weight_decay, bool adamw_mode, bool bias_correction, double grad_scale) {
  std::vector<AdamConsts> consts;
  consts.reserve(steps.size());
  for (const int64_t step : steps) {
    consts.push_back(make_consts(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale));
  }
  return consts;
}

void adam_step_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList out_copies, at::TensorList sources, at::IntArrayRef steps, double lr, double beta1,
                    double beta2, double eps, double weight_decay, bool adamw_mode, bool bias_correction,
                    double grad_scale, int64_t num_threads, int64_t simd, Body body) {
  check_args(params, grads, exp_avgs, exp_avg_sqs, out_copies, sources, steps, lr, beta1, beta2, eps, weight_decay,
             simd);
  TORCH_CHECK_VALUE(std::isfinite(grad_scale), "adam_step_: grad_scale must be finite, got ", grad_scale);
  const size_t n = params.size();
  const std::vector<AdamConsts> consts =
      consts_for(steps, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  std::vector<AdamSpan> spans;
  spans.reserve(n);
  std::vector<int64_t> offsets(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const bool has_out = !out_copies.empty();
    const bool apart = !sources.empty();
    float* p = params[i].data_ptr<float>();
    float* m = exp_avgs[i].data_ptr<float>();
    float* v = exp_avg_sqs[i].data_ptr<float>();
    spans.push_back(AdamSpan{p, grads[i].data_ptr(), m, v, apart ? sources[i].data_ptr<float>() : p,
                             apart ? sources[n + i].data_ptr<float>() : m,
                             apart ? sources[2 * n + i].data_ptr<float>() : v,
                             has_out ? out_copies[i].data_ptr() : nullptr, params[i].numel(), dtype_of(grads[i]), has_out ? dtype_of(out_copies[i]) : Dtype::kNone,
                             &consts[i]});
    offsets[i + 1] = offsets[i] + params[i].numel();
  }
  constexpr int64_t kMinPerThread = 1 << 15;  // elements: below this, threads cost more than they save
  constexpr int64_t kAlign = 64;               // elements: whole cache lines for fp32 and 16-bit data
  const RunSpanFn run = kernel_for(simd);
  run_slices(offsets, num_threads, kMinPerThread, kAlign,
             [&](size_t s, int64_t begin, int64_t end) { run(spans[s], begin, end, body); });
}

void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList out_copies, at::IntArrayRef steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw_mode, bool bias_correction, double grad_scale, int64_t num_threads,
               int64_t simd, at::TensorList sources) {
  adam_step_impl(params, grads, exp_avgs, exp_avg_sqs, out_copies, sources, steps, lr, beta1, beta2, eps,
                 weight_decay, adamw_mode, bias_correction, grad_scale, num_threads, simd, Body::kAdam);
}

// adam_step's arithmetic, only the weights written into out_copies (required): the state is left as it was, for
// a later adam_step with the same arguments to commit (the master it writes is the one the copy was rounded from).
void adam_peek(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList out_copies, at::IntArrayRef steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw_mode, bool bias_correction, double grad_scale, int64_t num_threads,
               int64_t simd, at::TensorList sources) {
  TORCH_CHECK_VALUE(out_copies.size() == params.size(),
                    "adam_peek_: out_copies must have one tensor per param (the peek writes only the weights); got ",
                    out_copies.size(), " for ", params.size(), " params");
  adam_step_impl(params, grads, exp_avgs, exp_avg_sqs, out_copies, sources, steps, lr, beta1, beta2, eps,
                 weight_decay, adamw_mode, bias_correction, grad_scale, num_threads, simd, Body::kPeek);
}

// Same memory traffic as adam_step (reads p, g, m, v; writes p, m, v, out; in
// place or apart), or with `peek` as adam_peek (reads p, g, m, v; writes out), no Adam arithmetic: what the memory
// system allows for this access pattern.
void bandwidth_probe(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList out_copies, int64_t num_threads, int64_t simd, at::TensorList sources, bool peek) {
  std::vector<int64_t> steps(params.size(), 1);
  adam_step_impl(params, grads, exp_avgs, exp_avg_sqs, out_copies, sources, steps, 0.0, 0.0, 0.0, 0.0, 0.0, true,
                 true, 1.0, num_threads, simd, peek ? Body::kPeekProbe : Body::kProbe);
}

int64_t cpu_simd_level() { return best_simd(); }

int64_t q8_blocks(int64_t numel) { return (numel + kQ8Block - 1) / kQ8Block; }

// Every 8-bit argument is checked before anything is written (the float32 path's rules for the rest).
bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

void check_q8_args(at::TensorList params, at::TensorList grads, at::TensorList out_copies, at::TensorList m_codes,
                   at::TensorList m_scales, at::TensorList v_codes, at::TensorList v_scales,
                   at::IntArrayRef index_bases, at::TensorList master_lows) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(master_lows.empty() || master_lows.size() == n,
                    "adam_step_q8_: master_lows must be empty (float32 masters) or have one tensor per param (24-bit "
                    "masters); got ", master_lows.size(), " for ", n, " params");
  TORCH_CHECK_VALUE(m_codes.size() == n && m_scales.size() == n && v_codes.size() == n && v_scales.size() == n &&
                        index_bases.size() == n,
                    "adam_step_q8_: params, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales and "
                    "index_bases must have the same length; got ", n, ", ", m_codes.size(), ", ", m_scales.size(),
                    ", ", v_codes.size(), ", ", v_scales.size(), ", ", index_bases.size());
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const struct {
      const at::Tensor& t;
      const char* name;
      at::ScalarType dtype;
      int64_t numel;
      const char* unit;
    } parts[] = {{m_codes[i], "exp_avg_codes", at::kChar, p.numel(), "code per element"},
                 {v_codes[i], "exp_avg_sq_codes", at::kByte, p.numel(), "code per element"},
                 {m_scales[i], "exp_avg_scales", at::kByte, q8_blocks(p.numel()), "scale per block of 256 elements"},
                 {v_scales[i], "exp_avg_sq_scales", at::kByte, q8_blocks(p.numel()), "scale per block of 256 elements"}};
    for (const auto& part : parts) {
      TORCH_CHECK_TYPE(part.t.scalar_type() == part.dtype, part.name, "[", i, "] has dtype ", part.t.scalar_type(),
                       "; expected ", part.dtype);
      TORCH_CHECK_VALUE(part.t.device().is_cpu() && part.t.is_contiguous(), part.name, "[", i,
                        "] must be a contiguous CPU tensor");
      TORCH_CHECK_VALUE(part.t.numel() == part.numel, part.name, "[", i, "] has ", part.t.numel(),
                        " elements; expected ", part.numel, " (one ",
                        part.unit,
                        " of params[", i, "], which has ", p.numel(), ")");
    }
    TORCH_CHECK_VALUE(index_bases[i] >= 0, "index_bases[", i, "] must be >= 0, got ", index_bases[i]);
    if (!master_lows.empty()) {
      const at::Tensor& lo = master_lows[i];
      TORCH_CHECK_TYPE(lo.scalar_type() == at::kByte, "master_lows[", i, "] has dtype ", lo.scalar_type(),
                       "; expected Byte (a 24-bit master's low 8 bits)");
      check_tensor(lo, "master_lows", i, p);
      // Pass 2 writes the weight copy after pass 1 read the gradient and the master: neither may share their memory.
      for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&grads[i], "grads"},
                                    {out_copies.empty() ? nullptr : &out_copies[i], "out_copies"}}) {
        TORCH_CHECK_VALUE(t == nullptr || (!overlaps(*t, p) && !overlaps(*t, lo)), name, "[", i,
                          "] shares memory with the 24-bit master of params[", i,
                          "] (its bfloat16 top half or master_lows); pass a separate tensor");
      }
    }
  }
}

void adam_step_q8_impl(at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList m_scales,
                       at::TensorList v_codes, at::TensorList v_scales, at::TensorList out_copies,
                       at::IntArrayRef steps, at::IntArrayRef index_bases, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool adamw_mode, bool bias_correction, double grad_scale,
                       int64_t num_threads, int64_t simd, Body body, at::TensorList master_lows) {
  // The float32 path's checks of params, grads, out copies, steps and hyper-parameters (params stand in for the
  // moments there); then the 8-bit state's.
  const bool m24 = !master_lows.empty();
  check_args(params, grads, params, params, out_copies, {}, steps, lr, beta1, beta2, eps, weight_decay, simd,
             m24 ? at::kBFloat16 : at::kFloat);
  check_q8_args(params, grads, out_copies, m_codes, m_scales, v_codes, v_scales, index_bases, master_lows);
  TORCH_CHECK_VALUE(std::isfinite(grad_scale), "adam_step_q8_: grad_scale must be finite, got ", grad_scale);
  const size_t n = params.size();
  const std::vector<AdamConsts> consts =
      consts_for(steps, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  std::vector<Q8Span> spans;
  std::vector<int64_t> first_block(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const bool has_out = !out_copies.empty();
    spans.push_back(Q8Span{m24 ? nullptr : params[i].data_ptr<float>(), grads[i].data_ptr(), m_codes[i].data_ptr<int8_t>(),
                           m_scales[i].data_ptr<uint8_t>(), v_codes[i].data_ptr<uint8_t>(),
                           v_scales[i].data_ptr<uint8_t>(), has_out ? out_copies[i].data_ptr() : nullptr,
                           params[i].numel(), static_cast<uint32_t>(index_bases[i]), static_cast<uint32_t>(steps[i]),
                           dtype_of(grads[i]), has_out ? dtype_of(out_copies[i]) : Dtype::kNone, &consts[i], body,
                           m24 ? static_cast<bf16_t*>(params[i].data_ptr()) : nullptr,
                           m24 ? master_lows[i].data_ptr<uint8_t>() : nullptr});
    first_block[i + 1] = first_block[i] + q8_blocks(params[i].numel());
  }
  // Whole blocks per thread: a block's scale is written by the one thread that encodes it.
  constexpr int64_t kMinBlocksPerThread = (1 << 15) / kQ8Block;
  const RunQ8Fn run = q8_kernel_for(simd);
  run_slices(first_block, num_threads, kMinBlocksPerThread, 1,
             [&](size_t s, int64_t begin, int64_t end) { run(spans[s], begin, end); });
}

void adam_step_q8(at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList m_scales,
                  at::TensorList v_codes, at::TensorList v_scales, at::TensorList out_copies, at::IntArrayRef steps,
                  at::IntArrayRef index_bases, double lr, double beta1, double beta2, double eps, double weight_decay,
                  bool adamw_mode, bool bias_correction, double grad_scale, int64_t num_threads, int64_t simd,
                  at::TensorList master_lows) {
  adam_step_q8_impl(params, grads, m_codes, m_scales, v_codes, v_scales, out_copies, steps, index_bases, lr, beta1,
                    beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale, num_threads, simd, Body::kAdam,
                    master_lows);
}

// adam_step_q8's arithmetic, only the weights written into out_copies (required): codes, scales and masters are
// left as they were, for a later adam_step_q8 with the same arguments to commit (the master it stores is the one
// the copy was rounded from, 24-bit rounding included).
void adam_peek_q8(at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList m_scales,
                  at::TensorList v_codes, at::TensorList v_scales, at::TensorList out_copies, at::IntArrayRef steps,
                  at::IntArrayRef index_bases, double lr, double beta1, double beta2, double eps, double weight_decay,
                  bool adamw_mode, bool bias_correction, double grad_scale, int64_t num_threads, int64_t simd,
                  at::TensorList master_lows) {
  TORCH_CHECK_VALUE(out_copies.size() == params.size(),
                    "adam_peek_q8_: out_copies must have one tensor per param (the peek writes only the weights); "
                    "got ", out_copies.size(), " for ", params.size(), " params");
  adam_step_q8_impl(params, grads, m_codes, m_scales, v_codes, v_scales, out_copies, steps, index_bases, lr, beta1,
                    beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale, num_threads, simd, Body::kPeek,
                    master_lows);
}

// The 8-bit mode's memory ceiling: its loads and stores, no Adam arithmetic (`peek`: the peek's, which stores
// only the copies, then required).
void bandwidth_probe_q8(at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList m_scales,
                        at::TensorList v_codes, at::TensorList v_scales, at::TensorList out_copies,
                        int64_t num_threads, int64_t simd, at::TensorList master_lows, bool peek) {
  TORCH_CHECK_VALUE(!peek || out_copies.size() == params.size(),
                    "bandwidth_probe_q8_: peek=True needs one out copy per param; got ", out_copies.size(), " for ",
                    params.size(), " params");
  std::vector<int64_t> steps(params.size(), 1), bases(params.size(), 0);
  adam_step_q8_impl(params, grads, m_codes, m_scales, v_codes, v_scales, out_copies, steps, bases, 0.0, 0.0, 0.0, 0.0,
                    0.0, true, true, 1.0, num_threads, simd, peek ? Body::kPeekProbe : Body::kProbe, master_lows);
}

}  // namespace

TORCH_LIBRARY(twinflow, m) {
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] out_copies, int[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adamw_mode, bool bias_correction, float grad_scale, int num_threads, int simd, Tensor[] sources) -> ()");
  m.def(
      "adam_peek_(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
      "Tensor(d!)[] out_copies, int[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adamw_mode, bool bias_correction, float grad_scale, int num_threads, int simd, Tensor[] sources) -> ()");
  m.def(
      "bandwidth_probe_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] out_copies, int num_threads, int simd, Tensor[] sources, bool peek=False) -> ()");
  m.def(
      "adam_step_q8_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg_codes, Tensor(c!)[] exp_avg_scales, "
      "Tensor(d!)[] exp_avg_sq_codes, Tensor(e!)[] exp_avg_sq_scales, Tensor(f!)[] out_copies, int[] steps, "
      "int[] index_bases, float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw_mode, "
      "bool bias_correction, float grad_scale, int num_threads, int simd, Tensor(g!)[] master_lows) -> ()");
  m.def(
      "adam_peek_q8_(Tensor[] params, Tensor[] grads, Tensor[] exp_avg_codes, Tensor[] exp_avg_scales, "
      "Tensor[] exp_avg_sq_codes, Tensor[] exp_avg_sq_scales, Tensor(f!)[] out_copies, int[] steps, "
      "int[] index_bases, float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw_mode, "
      "bool bias_correction, float grad_scale, int num_threads, int simd, Tensor[] master_lows) -> ()");
  m.def(
      "bandwidth_probe_q8_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg_codes, "
      "Tensor(c!)[] exp_avg_scales, Tensor(d!)[] exp_avg_sq_codes, Tensor(e!)[] exp_avg_sq_scales, "
      "Tensor(f!)[] out_copies, int num_threads, int simd, Tensor(g!)[] master_lows, bool peek=False) -> ()");
  m.def("cpu_simd_level() -> int", &cpu_simd_level);
  m.def("q8_block_size() -> int", []() -> int64_t { return kQ8Block; });
}

// Registered for every backend so that a CUDA tensor reaches check_args and gets
// a clear ValueError instead of a missing-kernel error.
TORCH_LIBRARY_IMPL(twinflow, CompositeExplicitAutograd, m) {
  m.impl("adam_step_", &adam_step);
  m.impl("adam_peek_", &adam_peek);
  m.impl("bandwidth_probe_", &bandwidth_probe);
  m.impl("adam_step_q8_", &adam_step_q8);
  m.impl("adam_peek_q8_", &adam_peek_q8);
  m.impl("bandwidth_probe_q8_", &bandwidth_probe_q8);
}

}  // namespace twinflow
