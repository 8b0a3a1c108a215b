// The Adam/AdamW update, written once over a vector type V. Included by each
// ISA translation unit inside its own namespace, after `adam_span.h`,
// `vec_scalar.h` and that ISA's vector header.
//
// Per element, with g converted to fp32 in registers:
//   g *= grad_scale (if not 1)
//   Adam  (L2):  g += wd * p
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   AdamW:       p *= 1 - lr * wd
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// and, if requested, out = round(p) to bf16/fp16 in the same pass. Out of
// place (kApart), p, m and v are read from one place and written to another,
// with streaming stores: the written lines are not in cache, and a plain store
// would first read each of them (12 more bytes per element).
#pragma once

template <class V, Body kBody, bool kApart, class G, class O>
inline void step_lanes(float* p, const G* g, float* m, float* v, O* out, const float* p_in, const float* m_in,
                       const float* v_in, const AdamConsts& c) {
  using reg = typename V::reg;
  reg grad = V::load(g);
  reg param = V::load(p_in);
  reg m_new = V::load(m_in);
  reg v_new = V::load(v_in);
  if constexpr (kBody == Body::kProbe || kBody == Body::kPeekProbe) {
    // Same loads and stores, no Adam arithmetic: the bandwidth ceiling.
    param = V::add(param, grad);
    m_new = V::add(m_new, grad);
    v_new = V::add(v_new, grad);
  } else {
    if (c.grad_scale != 1.0f) {
      grad = V::mul(grad, V::set1(c.grad_scale));
    }
    if (c.l2_decay != 0.0f) {  // skipped, not multiplied by 0: 0 * inf would be NaN
      grad = V::fmadd(V::set1(c.l2_decay), param, grad);
    }
    m_new = V::fmadd(V::set1(c.beta1), m_new, V::mul(V::set1(c.one_minus_beta1), grad));
    v_new = V::fmadd(V::set1(c.beta2), v_new, V::mul(V::set1(c.one_minus_beta2), V::mul(grad, grad)));
    const reg denom = V::fmadd(V::sqrt(v_new), V::set1(c.inv_bc2_sqrt), V::set1(c.eps));
    param = V::mul(param, V::set1(c.param_scale));
    param = V::fmadd(V::set1(-c.step_size), V::div(m_new, denom), param);
  }
  if constexpr (kBody == Body::kPeek || kBody == Body::kPeekProbe) {
    // the weights only: the state stays as it was
  } else if constexpr (kApart) {
    V::stream(p, param);
    V::stream(m, m_new);
    V::stream(v, v_new);
  } else {
    V::store(p, param);
    V::store(m, m_new);
    V::store(v, v_new);
  }
  V::store(out, param);
}

template <class V, Body kBody, bool kApart, class G, class O>
void step_range(const AdamSpan& s, int64_t begin, int64_t end) {
  float* p = s.param;
  const G* g = static_cast<const G*>(s.grad);
  float* m = s.exp_avg;
  float* v = s.exp_avg_sq;
  const float* p_in = s.param_in;
  const float* m_in = s.exp_avg_in;
  const float* v_in = s.exp_avg_sq_in;
  O* out = static_cast<O*>(s.out);
  const AdamConsts& c = *s.consts;
  auto out_at = [out](int64_t i) {
    if constexpr (std::is_same_v<O, no_out_t>) {
      return out;  // never dereferenced, and may be null
    } else {
      return out + i;
    }
  };
  // Software prefetch this far ahead keeps more memory requests in flight
  // than the hardware prefetcher alone while the divide/sqrt chain runs
  // (measured: +7% on a 16-core Xeon, BENCHMARKS.md).
  constexpr int64_t ahead = 512;
  // Single elements (the head and the tail) take the same operations as the
  // vector lanes (fused where V's fmadd is fused), so each element's result
  // does not depend on whether it landed in the vector loop or not.
  using Tail = VecScalarOf<V::kFusedMultiplyAdd>;
  int64_t i = begin;
  if constexpr (kApart) {  // up to the first output cache line, where streaming stores can start
    for (; i < end && (reinterpret_cast<uintptr_t>(p + i) & 63) != 0; ++i) {
      step_lanes<Tail, kBody, kApart>(p + i, g + i, m + i, v + i, out_at(i), p_in + i, m_in + i, v_in + i, c);
    }
  }
  for (; i + V::kWidth <= end; i += V::kWidth) {
    if (i + ahead < end && ((i * static_cast<int64_t>(sizeof(float))) & 63) < V::kWidth * 4) {
      V::prefetch(p_in + i + ahead);
      V::prefetch(m_in + i + ahead);
      V::prefetch(v_in + i + ahead);
      V::prefetch(g + i + ahead);
    }
    step_lanes<V, kBody, kApart>(p + i, g + i, m + i, v + i, out_at(i), p_in + i, m_in + i, v_in + i, c);
  }
  for (; i < end; ++i) {
    step_lanes<Tail, kBody, kApart>(p + i, g + i, m + i, v + i, out_at(i), p_in + i, m_in + i, v_in + i, c);
  }
  if constexpr (kApart || !std::is_same_v<O, no_out_t>) {
    V::fence_streams();  // order the streaming stores before whoever reads the copy next
  }
}

template <class V, Body kBody, bool kApart, class G>
void dispatch_out(const AdamSpan& s, int64_t begin, int64_t end) {
  switch (s.out_dtype) {
    case Dtype::kBFloat16:
      return step_range<V, kBody, kApart, G, bf16_t>(s, begin, end);
    case Dtype::kFloat16:
      return step_range<V, kBody, kApart, G, fp16_t>(s, begin, end);
    case Dtype::kFloat32:  // a staging copy for float32 models
      return step_range<V, kBody, kApart, G, float>(s, begin, end);
    default:
      return step_range<V, kBody, kApart, G, no_out_t>(s, begin, end);
  }
}

template <class V, Body kBody, bool kApart>
void dispatch_grad(const AdamSpan& s, int64_t begin, int64_t end) {
  switch (s.grad_dtype) {
    case Dtype::kBFloat16:
      return dispatch_out<V, kBody, kApart, bf16_t>(s, begin, end);
    case Dtype::kFloat16:
      return dispatch_out<V, kBody, kApart, fp16_t>(s, begin, end);
    default:
      return dispatch_out<V, kBody, kApart, float>(s, begin, end);
  }
}

template <class V, Body kBody>
void dispatch_place(const AdamSpan& s, int64_t begin, int64_t end) {
  if (s.param_in != s.param) {
    dispatch_grad<V, kBody, true>(s, begin, end);
  } else {
    dispatch_grad<V, kBody, false>(s, begin, end);
  }
}

template <class V>
void run_span_impl(const AdamSpan& s, int64_t begin, int64_t end, Body body) {
  switch (body) {
    case Body::kProbe:
      return dispatch_place<V, Body::kProbe>(s, begin, end);
    case Body::kPeek:
      return dispatch_place<V, Body::kPeek>(s, begin, end);
    case Body::kPeekProbe:
      return dispatch_place<V, Body::kPeekProbe>(s, begin, end);
    default:
      return dispatch_place<V, Body::kAdam>(s, begin, end);
  }
}
