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
// for bit (twinflow/compact.py).
//
// The codes are small floating-point numbers relative to the block. A block's
// scale is a power of two kept as its float32 exponent field F (one byte),
// chosen so that its largest magnitude stays within the top code. A code's
// magnitude a has a relative exponent field a >> 3 and 3 mantissa bits; with
// D = F - top field, a code with field >= 1 is the float32 whose bit pattern is
// (a << 20) + (D << 23), and the bottom field (a < 8) holds evenly spaced values
// (a & 7) / 8 * 2^(D - 126) below the block's lowest binade, as float32's own
// subnormals would. Decoding and encoding work on bit patterns: a shift and an
// integer add of D << 23; in the bottom field, a subtraction (decode) or an
// addition (encode) of 2^(D - 126), the block's lowest normal value, whose
// binade's spacing is the bottom field's. Encoding adds random bits below the
// kept mantissa to the pattern before the shift (stochastic rounding, unbiased
// in value). No square root, division or multiply, and no float32 subnormal
// appears on the way: on x86 a vector operation with a subnormal input or
// result takes a slow microcode assist, and trained moments fill the bottom
// field far more often than random ones do. (The one exception: blocks whose
// scale is below 2^(top field + 3 - 127), where the bottom field itself is
// subnormal.) exp_avg keeps a sign and 4 exponent bits (top field 15: down to
// 2^-14 of the block's top binade), exp_avg_sq 5 (top field 31: down to 2^-30,
// so that a small v beside a large one in its block keeps a code and its
// update stays bounded). Each call clears flush-to-zero and
// denormals-are-zero for its own thread while it runs, so that those rare
// blocks, and Adam's own arithmetic, round as the reference does.
//
// 24-bit masters (state_precision "int8_m24", Q8Span::master_lo set): the
// master is a float32's top 24 bits, kept as its top 16 (a bfloat16) and the
// next 8. Pass 1 keeps the new master in a block buffer; pass 2 adds the low
// 8 bits of the element's hash to its bit pattern and cuts the low 8 bits
// (stochastic rounding of the magnitude, unbiased in value), and writes the
// weight copy from the rounded master.
#pragma once

constexpr int32_t kQ8MantShift = 20;       // float32 mantissa bits below the 3 a code keeps
constexpr int32_t kQ8TopFieldM = 15;       // exp_avg: 4 exponent bits
constexpr int32_t kQ8TopFieldV = 31;       // exp_avg_sq: 5 exponent bits
constexpr uint32_t kQ8Salt = 0x2545F491u;  // the rounding noise's stream

// 2^(field - 127) for a float32 exponent field in [1, 254].
inline float q8_pow2(int32_t field) { return VecScalarOf<false>::float_of(static_cast<uint32_t>(field) << 23); }

// A block's constants: D << 23, added to a code's bit pattern; 2^(D - 126), its lowest normal value, and that
// value's bit pattern.
struct Q8Scale {
  int32_t shift;
  float floor;
  int32_t floor_bits;
};

inline Q8Scale q8_scale(uint8_t field, int32_t top) {
  const int32_t d = std::max<int32_t>(field - top, 0);
  return {d << 23, q8_pow2(d + 1), (d + 1) << 23};
}

// The block's exponent field: the largest magnitude's, one higher where it would round above the top code.
inline uint8_t q8_field(float largest, int32_t top) {
  const uint32_t f = (VecScalarOf<false>::bits_of(largest) + (1u << kQ8MantShift)) >> 23;
  return static_cast<uint8_t>(std::min<int32_t>(std::max<int32_t>(static_cast<int32_t>(f), top), 254));
}

// Codes' magnitudes a (int32 lanes) and sign bits -> float32 values.
template <class V>
inline typename V::reg q8_decode(typename V::ireg a, typename V::ireg sign, const Q8Scale& k) {
  using reg = typename V::reg;
  const typename V::ireg b = V::iadd(V::template sll<kQ8MantShift>(a), V::iset1(k.shift));
  // bottom field: (1 + mantissa / 8) * 2^(D - 126) - 2^(D - 126), exact (both within one binade)
  const reg low = V::sub(V::from_bits(V::iadd(b, V::iset1(1 << 23))), V::set1(k.floor));
  const reg mag = V::select_ge(a, V::iset1(8), V::from_bits(b), low);
  return V::from_bits(V::ior(V::bits(mag), sign));
}

// Magnitudes x >= 0 (at most the block's top value) -> codes, rounded up with the probability that keeps the value
// right on average; r: the rounding offset, 16 random bits and half a step of them (q8_noise).
template <class V>
inline typename V::ireg q8_encode(typename V::reg x, typename V::ireg r, const Q8Scale& k, int32_t top_code) {
  using ireg = typename V::ireg;
  // below the lowest binade: x + 2^(D - 126) rounds x to that binade's spacing, 2^20 times finer than a code step
  const ireg low = V::isub(V::bits(V::add(x, V::set1(k.floor))), V::iset1(k.floor_bits));
  const ireg y = V::select_ge(x, V::set1(k.floor), V::isub(V::bits(x), V::iset1(k.shift)), low);
  return V::imin(V::template srl<kQ8MantShift>(V::iadd(y, r)), V::iset1(top_code));
}

// The rounding offset of the 16 hash bits starting at bit kLow: those bits at bits 4..19 (below the 3 mantissa
// bits a code keeps), and half a step below them. Shifted first, then masked and set (one ternary-logic
// operation on AVX-512).
template <class V, int kLow>
inline typename V::ireg q8_noise(typename V::ireg h) {
  constexpr int kShift = kLow - (kQ8MantShift - 16);
  const typename V::ireg placed = kShift >= 0 ? V::template srl<(kShift > 0 ? kShift : 0)>(h)
                                              : V::template sll<(kShift < 0 ? -kShift : 0)>(h);
  return V::ior(V::iand(placed, V::iset1(0xFFFF << (kQ8MantShift - 16))), V::iset1(1 << (kQ8MantShift - 17)));
}

// A 24-bit master (state_precision "int8_m24"): the float32 whose top 24 bits are hi (16) and lo (8), the rest 0.
// hi loads as the bfloat16 it is (its bits already in the top half); lo fills the next byte.
template <class V>
inline typename V::reg m24_decode(const Q8Span& s, int64_t i) {
  return V::load_master24(s.master_hi + i, s.master_lo + i);
}

// A float32 master to 24 bits, rounded up in magnitude with the probability that keeps it right on average
// (noise: 8 random bits per lane): its top 24 bits (the pattern shifted right by 8). A NaN is cut, not rounded:
// with its payload all ones (CUDA's NaN) the add would carry into the sign, giving -0.
template <class V>
inline typename V::ireg m24_round(typename V::reg x, typename V::ireg noise) {
  noise = V::select_ge(V::abs(x), V::set1(0.0f), noise, V::iset1(0));  // false only for NaN
  return V::template srl<8>(V::iadd(V::bits(x), noise));
}

// m24_round, stored as the 24-bit master; returns its top 24 bits.
template <class V>
inline typename V::ireg m24_encode(const Q8Span& s, int64_t i, typename V::reg x, typename V::ireg noise) {
  const typename V::ireg t = m24_round<V>(x, noise);
  V::store(&s.master_hi[i].bits, V::template srl<8>(t));
  V::store(s.master_lo + i, V::iand(t, V::iset1(0xFF)));
  return t;
}

// The weight copy of a rounded 24-bit master t (its top 24 bits). A bfloat16 weight is the master rounded to the
// nearest, ties away from zero (as the device side keeps its weights, twinflow/weight_master.py): bit 0 set
// where the cut byte is 0x80 or more turns a tie into a value above it, which the store's round-to-nearest-even
// takes up in magnitude; nothing else moves. Any other copy is the master itself.
// m24_weight's bfloat16 pattern (in int32 lanes): the same as storing (t << 8) | tie with round-to-nearest-even,
// in fewer operations: adding 0x80 carries into the kept 16 bits exactly where the cut byte is 0x80 or more. A NaN
// (exponent all ones, a mantissa bit set anywhere in the 24) becomes the quiet NaN the conversion stores.
template <class V>
inline typename V::ireg m24_weight_bits(typename V::ireg t) {
  const typename V::ireg up = V::template srl<8>(V::iadd(t, V::iset1(0x80)));
  return V::select_ge(V::iand(t, V::iset1(0x7FFFFF)), V::iset1(0x7F8001), V::iset1(0x7FC0), up);
}

template <class V, class O>
inline void m24_weight(const Q8Span& s, int64_t i, typename V::ireg t) {
  using ireg = typename V::ireg;
  if constexpr (std::is_same_v<O, bf16_t>) {
    V::store_bits16(static_cast<O*>(s.out) + i, m24_weight_bits<V>(t));
  } else if constexpr (!std::is_same_v<O, no_out_t>) {
    V::store(static_cast<O*>(s.out) + i, V::from_bits(V::template sll<8>(t)));
  }
}

// A call's constants, with the two optional terms tested once (a float compare in the loop costs more than a
// flag's).
struct Q8Consts : AdamConsts {
  bool scaled, l2;
  explicit Q8Consts(const AdamConsts& c) : AdamConsts(c), scaled(c.grad_scale != 1.0f), l2(c.l2_decay != 0.0f) {}
};

// The update's arithmetic on a vector of elements: the new master (unrounded) and moments.
template <class V>
struct Q8Step {
  typename V::reg param, m, v;
};

template <class V, class G, bool kM24>
inline Q8Step<V> q8_step_lanes(const Q8Span& s, const Q8Consts& c, int64_t i, const Q8Scale& km,
                               const Q8Scale& kv) {
  using reg = typename V::reg;
  using ireg = typename V::ireg;
  reg grad = V::load(static_cast<const G*>(s.grad) + i);
  reg param = kM24 ? m24_decode<V>(s, i) : V::load(s.param + i);
  const ireg cm = V::load(s.m_codes + i);
  const reg m = q8_decode<V>(V::iabs(cm), V::iand(cm, V::iset1(INT32_MIN)), km);
  const reg v = q8_decode<V>(V::load(s.v_codes + i), V::iset1(0), kv);
  if (c.scaled) grad = V::mul(grad, V::set1(c.grad_scale));
  if (c.l2) grad = V::add(grad, V::mul(V::set1(c.l2_decay), param));
  const reg m_new = V::add(V::mul(V::set1(c.beta1), m), V::mul(V::set1(c.one_minus_beta1), grad));
  const reg v_new = V::add(V::mul(V::set1(c.beta2), v), V::mul(V::set1(c.one_minus_beta2), V::mul(grad, grad)));
  const reg denom = V::add(V::mul(V::sqrt(v_new), V::set1(c.inv_bc2_sqrt)), V::set1(c.eps));
  param = V::mul(param, V::set1(c.param_scale));
  param = V::sub(param, V::mul(V::set1(c.step_size), V::div(m_new, denom)));
  return {param, m_new, v_new};
}

// Pass 1 over a block: decode, step, keep the new moments (and, with 24-bit masters, the new master: it is
// rounded with the same per-element hash in pass 2) in block buffers while tracking the largest.
template <class V, class G, class O, bool kM24>
inline void q8_decode_step(const Q8Span& s, const Q8Consts& c, int64_t i, const Q8Scale& km, const Q8Scale& kv,
                           float* mbuf, float* vbuf, float* pbuf, typename V::reg& max_m, typename V::reg& max_v) {
  const Q8Step<V> r = q8_step_lanes<V, G, kM24>(s, c, i, km, kv);
  if constexpr (kM24) {
    V::store(pbuf, r.param);
  } else {
    V::store(s.param + i, r.param);
    if constexpr (!std::is_same_v<O, no_out_t>) {
      V::store(static_cast<O*>(s.out) + i, r.param);
    }
  }
  V::store(mbuf, r.m);
  V::store(vbuf, r.v);
  max_m = V::max(max_m, V::abs(r.m));
  max_v = V::max(max_v, r.v);
}

// exp_avg's signed code, rounded with the hash's low 16 bits.
template <class V>
inline typename V::ireg q8_encode_m(typename V::reg m, typename V::ireg h, const Q8Scale& km) {
  return V::negate_if_signed(q8_encode<V>(V::abs(m), q8_noise<V, 0>(h), km, 127), V::bits(m));
}

// exp_avg_sq's code, rounded with the hash's high 16 bits. A positive v keeps at least the lowest code: one
// rounded to zero beside a nonzero m would make the update m / eps (min(bits, 1) is 1 for v > 0, else 0).
template <class V>
inline typename V::ireg q8_encode_v(typename V::reg v, typename V::ireg h, const Q8Scale& kv) {
  const typename V::ireg cv = q8_encode<V>(v, q8_noise<V, 16>(h), kv, 255);
  return V::imax(cv, V::imin(V::bits(v), V::iset1(1)));
}

// Stochastic rounding key: new every step (added to the element's index before the hash).
inline uint32_t q8_key(uint32_t step) { return step * 0x85EBCA77u ^ kQ8Salt; }

// Pass 2: encode the moments against the block's new scales (and round and store a 24-bit master, then its
// weight copy).
template <class V, class O, bool kM24>
inline void q8_encode_both(const Q8Span& s, int64_t i, const float* mbuf, const float* vbuf, const float* pbuf,
                           const Q8Scale& km, const Q8Scale& kv) {
  using ireg = typename V::ireg;
  // One hash per element: its low 16 bits round m, its high 16 bits v, its low 8 bits a 24-bit master (those
  // are m's least significant noise bits: a correlation far below anything either rounding can show).
  const ireg h = V::hash(s.index_base + static_cast<uint32_t>(i), q8_key(s.step));
  if constexpr (kM24) {
    m24_weight<V, O>(s, i, m24_encode<V>(s, i, V::load(pbuf), V::iand(h, V::iset1(0xFF))));
  }
  V::store(s.m_codes + i, q8_encode_m<V>(V::load(mbuf), h, km));
  V::store(s.v_codes + i, q8_encode_v<V>(V::load(vbuf), h, kv));
}

// q8_encode_both over V::kGroup vectors at once: the same values, the narrow stores of the group packed together
// (V::store_group). Each kind of output is finished for the whole group before the next, so that few registers
// are live at a time.
template <class V, class O, bool kM24>
inline void q8_encode_group(const Q8Span& s, int64_t i, const float* mbuf, const float* vbuf, const float* pbuf,
                            const Q8Scale& km, const Q8Scale& kv) {
  using ireg = typename V::ireg;
  constexpr int kG = V::kGroup, kW = V::kWidth;
  ireg h[kG], out[kG];
  for (int k = 0; k < kG; ++k) h[k] = V::hash(s.index_base + static_cast<uint32_t>(i + k * kW), q8_key(s.step));
  if constexpr (kM24) {
    ireg t[kG];
    for (int k = 0; k < kG; ++k) t[k] = m24_round<V>(V::load(pbuf + k * kW), V::iand(h[k], V::iset1(0xFF)));
    for (int k = 0; k < kG; ++k) out[k] = V::template srl<8>(t[k]);
    V::store_group(&s.master_hi[i].bits, out);
    for (int k = 0; k < kG; ++k) out[k] = V::iand(t[k], V::iset1(0xFF));
    V::store_group(s.master_lo + i, out);
    if constexpr (std::is_same_v<O, bf16_t>) {
      for (int k = 0; k < kG; ++k) out[k] = m24_weight_bits<V>(t[k]);
      V::store_group_bits16(static_cast<O*>(s.out) + i, out);
    } else {
      for (int k = 0; k < kG; ++k) m24_weight<V, O>(s, i + k * kW, t[k]);
    }
  }
  for (int k = 0; k < kG; ++k) out[k] = q8_encode_m<V>(V::load(mbuf + k * kW), h[k], km);
  V::store_group(s.m_codes + i, out);
  for (int k = 0; k < kG; ++k) out[k] = q8_encode_v<V>(V::load(vbuf + k * kW), h[k], kv);
  V::store_group(s.v_codes + i, out);
}

template <class V, class G, class O, bool kM24>
void q8_range(const Q8Span& span, int64_t block_begin, int64_t block_end) {
  using Tail = VecScalarOf<false>;
  // A local copy: the byte stores below may alias anything the compiler cannot see is private, so through the
  // reference every pointer and constant would be loaded again at every vector.
  const Q8Span s = span;
  alignas(64) float mbuf[kQ8Block];
  alignas(64) float vbuf[kQ8Block];
  alignas(64) float pbuf[kM24 ? kQ8Block : 1];
  const Q8Consts c(*s.consts);  // a local copy: the stores below cannot alias it, so it stays in registers
  for (int64_t j = block_begin; j < block_end; ++j) {
    const int64_t lo = j * kQ8Block;
    const int64_t n = std::min<int64_t>(kQ8Block, s.numel - lo);
    Q8Scale km = q8_scale(s.m_scales[j], kQ8TopFieldM), kv = q8_scale(s.v_scales[j], kQ8TopFieldV);
    typename V::reg vmax_m = V::set1(0.0f), vmax_v = V::set1(0.0f);
    float tmax_m = 0.0f, tmax_v = 0.0f;
    int64_t i = 0;
    for (; i + V::kWidth <= n; i += V::kWidth) {
      q8_decode_step<V, G, O, kM24>(s, c, lo + i, km, kv, mbuf + i, vbuf + i, pbuf + (kM24 ? i : 0), vmax_m, vmax_v);
    }
    for (; i < n; ++i) {
      q8_decode_step<Tail, G, O, kM24>(s, c, lo + i, km, kv, mbuf + i, vbuf + i, pbuf + (kM24 ? i : 0), tmax_m,
                                       tmax_v);
    }
    const uint8_t fm = q8_field(std::max(V::hmax(vmax_m), tmax_m), kQ8TopFieldM);
    const uint8_t fv = q8_field(std::max(V::hmax(vmax_v), tmax_v), kQ8TopFieldV);
    km = q8_scale(fm, kQ8TopFieldM);
    kv = q8_scale(fv, kQ8TopFieldV);
    i = 0;
    if constexpr (V::kGroup > 1) {
      for (; i + V::kGroup * V::kWidth <= n; i += V::kGroup * V::kWidth) {
        q8_encode_group<V, O, kM24>(s, lo + i, mbuf + i, vbuf + i, pbuf + (kM24 ? i : 0), km, kv);
      }
    }
    for (; i + V::kWidth <= n; i += V::kWidth) {
      q8_encode_both<V, O, kM24>(s, lo + i, mbuf + i, vbuf + i, pbuf + (kM24 ? i : 0), km, kv);
    }
    for (; i < n; ++i) {
      q8_encode_both<Tail, O, kM24>(s, lo + i, mbuf + i, vbuf + i, pbuf + (kM24 ? i : 0), km, kv);
    }
    s.m_scales[j] = fm;
    s.v_scales[j] = fv;
  }
  if constexpr (!std::is_same_v<O, no_out_t>) {
    V::fence_streams();
  }
}

// The peek (Body::kPeek): q8_range's arithmetic, only the weight copy written: the master the commit (a later
// q8_range with the same arguments) stores, rounded as it rounds it. Codes, scales and masters are left as they
// were, and no moment is encoded: the weights do not depend on this step's codes.
template <class V, class G, class O, bool kM24>
void q8_peek_range(const Q8Span& s, int64_t block_begin, int64_t block_end) {
  using Tail = VecScalarOf<false>;
  const Q8Consts c(*s.consts);
  auto lanes = [&](auto vec, int64_t i, const Q8Scale& km, const Q8Scale& kv) {
    using W = decltype(vec);
    const typename W::reg param = q8_step_lanes<W, G, kM24>(s, c, i, km, kv).param;
    if constexpr (kM24) {
      const typename W::ireg h = W::hash(s.index_base + static_cast<uint32_t>(i), q8_key(s.step));
      m24_weight<W, O>(s, i, m24_round<W>(param, W::iand(h, W::iset1(0xFF))));
    } else {
      W::store(static_cast<O*>(s.out) + i, param);
    }
  };
  for (int64_t j = block_begin; j < block_end; ++j) {
    const int64_t lo = j * kQ8Block;
    const int64_t n = std::min<int64_t>(kQ8Block, s.numel - lo);
    const Q8Scale km = q8_scale(s.m_scales[j], kQ8TopFieldM), kv = q8_scale(s.v_scales[j], kQ8TopFieldV);
    int64_t i = 0;
    for (; i + V::kWidth <= n; i += V::kWidth) lanes(V{}, lo + i, km, kv);
    for (; i < n; ++i) lanes(Tail{}, lo + i, km, kv);
  }
  V::fence_streams();
}

// The bandwidth probe of this access pattern: the same loads and stores (codes written back as read, scales
// rewritten), trivial arithmetic; kPeek: the peek's (every load, only the weight copy stored).
template <class V, class G, class O, bool kM24, bool kPeek>
void q8_probe_range(const Q8Span& s, int64_t block_begin, int64_t block_end) {
  using Tail = VecScalarOf<false>;
  const int64_t begin = block_begin * kQ8Block, end = std::min(s.numel, block_end * kQ8Block);
  auto lanes = [&](auto vec, int64_t i) {
    using W = decltype(vec);
    const typename W::reg master = kM24 ? m24_decode<W>(s, i) : W::load(s.param + i);
    typename W::reg x = W::add(master, W::load(static_cast<const G*>(s.grad) + i));
    if constexpr (kPeek) {  // the codes are read (their low bit kept in the copy's), nothing of the state written
      const typename W::ireg codes = W::iadd(W::load(s.m_codes + i), W::load(s.v_codes + i));
      W::store(static_cast<O*>(s.out) + i, W::from_bits(W::ior(W::bits(x), W::iand(codes, W::iset1(1)))));
      return;
    }
    if constexpr (kM24) {
      m24_encode<W>(s, i, x, W::iset1(0));
    } else {
      W::store(s.param + i, x);
    }
    if constexpr (!std::is_same_v<O, no_out_t>) {
      W::store(static_cast<O*>(s.out) + i, x);
    }
    W::store(s.m_codes + i, W::load(s.m_codes + i));
    W::store(s.v_codes + i, W::load(s.v_codes + i));
  };
  int64_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) lanes(V{}, i);
  for (; i < end; ++i) lanes(Tail{}, i);
  for (int64_t j = block_begin; j < block_end && !kPeek; ++j) {
    s.m_scales[j] = static_cast<uint8_t>(s.m_scales[j] + 1);
    s.v_scales[j] = static_cast<uint8_t>(s.v_scales[j] + 1);
  }
  if constexpr (!std::is_same_v<O, no_out_t>) {
    V::fence_streams();
  }
}

template <class V, class G, class O>
void q8_body(const Q8Span& s, int64_t begin, int64_t end) {
  const bool m24 = s.master_lo != nullptr;
  if constexpr (!std::is_same_v<O, no_out_t>) {  // a peek always writes a copy (checked by its caller)
    if (s.body == Body::kPeek) {
      return m24 ? q8_peek_range<V, G, O, true>(s, begin, end) : q8_peek_range<V, G, O, false>(s, begin, end);
    }
    if (s.body == Body::kPeekProbe) {
      return m24 ? q8_probe_range<V, G, O, true, true>(s, begin, end)
                 : q8_probe_range<V, G, O, false, true>(s, begin, end);
    }
  }
  if (s.body == Body::kProbe) {
    return m24 ? q8_probe_range<V, G, O, true, false>(s, begin, end)
               : q8_probe_range<V, G, O, false, false>(s, begin, end);
  }
  m24 ? q8_range<V, G, O, true>(s, begin, end) : q8_range<V, G, O, false>(s, begin, end);
}

template <class V, class G>
void q8_dispatch_out(const Q8Span& s, int64_t begin, int64_t end) {
  switch (s.out_dtype) {
    case Dtype::kBFloat16:
      return q8_body<V, G, bf16_t>(s, begin, end);
    case Dtype::kFloat16:
      return q8_body<V, G, fp16_t>(s, begin, end);
    case Dtype::kFloat32:
      return q8_body<V, G, float>(s, begin, end);
    default:
      return q8_body<V, G, no_out_t>(s, begin, end);
  }
}

template <class V>
void run_q8_impl(const Q8Span& s, int64_t begin, int64_t end) {
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr & ~0x8040u);  // subnormals as IEEE: flush-to-zero (bit 15) and denormals-are-zero (bit 6) off
  switch (s.grad_dtype) {
    case Dtype::kBFloat16:
      q8_dispatch_out<V, bf16_t>(s, begin, end);
      break;
    case Dtype::kFloat16:
      q8_dispatch_out<V, fp16_t>(s, begin, end);
      break;
    default:
      q8_dispatch_out<V, float>(s, begin, end);
  }
  _mm_setcsr(csr);
}
