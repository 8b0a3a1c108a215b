// Adam/AdamW over 8-bit moments (see Q8Span in adam_span.h), written once over
// a vector type V. Included by each ISA translation unit after adam_kernel.h.
//
// Per block: decode m and v, step exactly as adam_kernel.h does (the weight
// update uses the new moments in float32, before they are stored), keep the new
// moments in a block buffer while finding the block's largest |m| and v, then
// encode them against the new scales. Only plain multiplies and adds (no fused
// multiply-add), so every path, vector lanes and single elements alike, rounds
// the same: results do not depend on the instruction set or the thread split,
// and a float32 reference that does the same operations in order matches bit
// for bit.
#pragma once

template <class V, class G, class O>
inline void q8_decode_step(const Q8Span& s, int64_t i, float sm, float sw, float* mbuf, float* vbuf,
                           typename V::reg& max_m, typename V::reg& max_v) {
  using reg = typename V::reg;
  const AdamConsts& c = *s.consts;
  float* p = s.param + i;
  reg grad = V::load(static_cast<const G*>(s.grad) + i);
  reg param = V::load(p);
  const reg tm = V::mul(V::load(s.m_codes + i), V::set1(1.0f / 127.0f));
  const reg tv = V::mul(V::load(s.v_codes + i), V::set1(1.0f / 255.0f));
  const reg m = V::mul(V::set1(sm), V::mul(tm, V::abs(tm)));
  const reg w = V::mul(V::set1(sw), V::mul(tv, tv));
  const reg v = V::mul(w, w);
  if (c.grad_scale != 1.0f) grad = V::mul(grad, V::set1(c.grad_scale));
  if (c.l2_decay != 0.0f) grad = V::add(grad, V::mul(V::set1(c.l2_decay), param));
  const reg m_new = V::add(V::mul(V::set1(c.beta1), m), V::mul(V::set1(c.one_minus_beta1), grad));
  const reg v_new = V::add(V::mul(V::set1(c.beta2), v), V::mul(V::set1(c.one_minus_beta2), V::mul(grad, grad)));
  const reg denom = V::add(V::mul(V::sqrt(v_new), V::set1(c.inv_bc2_sqrt)), V::set1(c.eps));
  param = V::mul(param, V::set1(c.param_scale));
  param = V::sub(param, V::mul(V::set1(c.step_size), V::div(m_new, denom)));
  V::store(p, param);
  if constexpr (!std::is_same_v<O, no_out_t>) {
    V::store(static_cast<O*>(s.out) + i, param);
  }
  V::store(mbuf, m_new);
  V::store(vbuf, v_new);
  max_m = V::max(max_m, V::abs(m_new));
  max_v = V::max(max_v, v_new);
}

// Stochastic rounding keys: one stream for m, another for v, new every step.
inline uint32_t q8_key(uint32_t step, uint32_t salt) { return step * 0x85EBCA77u ^ salt; }
constexpr uint32_t kSaltM = 0x2545F491u;
constexpr uint32_t kSaltV = 0x9B97A4D3u;

// One code of x (relative to its block's scale, in [0, 1]) on the grid x = (c / top)^power, rounded up with the
// probability that makes the decoded value right on average: floor(y) or floor(y) + 1, y = top * x^(1 / power).
template <class V>
inline typename V::reg q8_code(typename V::reg x, typename V::reg y, typename V::reg u, float top, bool fourth) {
  using reg = typename V::reg;
  const reg lo = V::min(V::floor(y), V::set1(top - 1.0f));
  auto grid = [&](reg c) {
    const reg t = V::mul(c, V::set1(1.0f / top));
    const reg t2 = V::mul(t, t);
    return fourth ? V::mul(t2, t2) : t2;
  };
  const reg below = grid(lo);
  const reg up = V::div(V::sub(x, below), V::sub(grid(V::add(lo, V::set1(1.0f))), below));
  const reg p = V::min(V::max(up, V::set1(0.0f)), V::set1(1.0f));
  return V::min(V::add(lo, V::floor(V::add(p, u))), V::set1(top));
}

template <class V>
inline void q8_encode(const Q8Span& s, int64_t i, const float* mbuf, const float* vbuf, float inv_m, float inv_w) {
  using reg = typename V::reg;
  const uint32_t index = s.index_base + static_cast<uint32_t>(i);
  const reg m = V::load(mbuf);
  const reg xm = V::mul(V::abs(m), V::set1(inv_m));  // |m| / scale
  const reg ym = V::mul(V::set1(127.0f), V::sqrt(xm));
  const reg qm = q8_code<V>(xm, ym, V::uniform(index, q8_key(s.step, kSaltM)), 127.0f, false);
  V::store(s.m_codes + i, V::copysign(qm, m));
  const reg a = V::mul(V::sqrt(V::load(vbuf)), V::set1(inv_w));  // sqrt(v) / scale
  const reg yv = V::mul(V::set1(255.0f), V::sqrt(a));
  V::store(s.v_codes + i, q8_code<V>(V::mul(a, a), yv, V::uniform(index, q8_key(s.step, kSaltV)), 255.0f, true));
}

template <class V, class G, class O>
void q8_range(const Q8Span& s, int64_t block_begin, int64_t block_end) {
  using Tail = VecScalarOf<false>;
  alignas(64) float mbuf[kQ8Block];
  alignas(64) float vbuf[kQ8Block];
  for (int64_t j = block_begin; j < block_end; ++j) {
    const int64_t lo = j * kQ8Block;
    const int64_t n = std::min<int64_t>(kQ8Block, s.numel - lo);
    const float sm = s.m_scales[j], sw = s.v_scales[j];
    typename V::reg vmax_m = V::set1(0.0f), vmax_v = V::set1(0.0f);
    float tmax_m = 0.0f, tmax_v = 0.0f;
    int64_t i = 0;
    for (; i + V::kWidth <= n; i += V::kWidth) {
      q8_decode_step<V, G, O>(s, lo + i, sm, sw, mbuf + i, vbuf + i, vmax_m, vmax_v);
    }
    for (; i < n; ++i) {
      q8_decode_step<Tail, G, O>(s, lo + i, sm, sw, mbuf + i, vbuf + i, tmax_m, tmax_v);
    }
    const float max_m = std::max(V::hmax(vmax_m), tmax_m);
    const float scale_w = __builtin_sqrtf(std::max(V::hmax(vmax_v), tmax_v));
    const float inv_m = max_m > 0.0f ? 1.0f / max_m : 0.0f;
    const float inv_w = scale_w > 0.0f ? 1.0f / scale_w : 0.0f;
    for (i = 0; i + V::kWidth <= n; i += V::kWidth) {
      q8_encode<V>(s, lo + i, mbuf + i, vbuf + i, inv_m, inv_w);
    }
    for (; i < n; ++i) {
      q8_encode<Tail>(s, lo + i, mbuf + i, vbuf + i, inv_m, inv_w);
    }
    s.m_scales[j] = max_m;
    s.v_scales[j] = scale_w;
  }
  if constexpr (!std::is_same_v<O, no_out_t>) {
    V::fence_streams();
  }
}

template <class V, class G>
void q8_dispatch_out(const Q8Span& s, int64_t begin, int64_t end) {
  switch (s.out_dtype) {
    case Dtype::kBFloat16:
      return q8_range<V, G, bf16_t>(s, begin, end);
    case Dtype::kFloat16:
      return q8_range<V, G, fp16_t>(s, begin, end);
    case Dtype::kFloat32:
      return q8_range<V, G, float>(s, begin, end);
    default:
      return q8_range<V, G, no_out_t>(s, begin, end);
  }
}

template <class V>
void run_q8_impl(const Q8Span& s, int64_t begin, int64_t end) {
  switch (s.grad_dtype) {
    case Dtype::kBFloat16:
      return q8_dispatch_out<V, bf16_t>(s, begin, end);
    case Dtype::kFloat16:
      return q8_dispatch_out<V, fp16_t>(s, begin, end);
    default:
      return q8_dispatch_out<V, float>(s, begin, end);
  }
}
