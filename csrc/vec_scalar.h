// One-lane "vector": the scalar path, and the tail of every vector path.
// Included inside an ISA namespace, so each translation unit owns its copy.
//
// A vector path's tail must round exactly like its vector lanes: which elements
// fall in a tail depends on the thread split and on how tensors are grouped into
// calls, and results must not. So whether fmadd is fused is a property of the
// instantiation (each vector type's kFusedMultiplyAdd picks its tail type), not
// a preprocessor guess: g++ does not define __FMA__ under `#pragma GCC target`.
// Every kernel translation unit also turns -ffp-contract off, so the compiler
// cannot fuse a multiply and an add on its own (or pick which product to fuse).
#pragma once

template <bool kFused>
struct VecScalarOf {
  using reg = float;
  static constexpr int kWidth = 1;
  static constexpr bool kFusedMultiplyAdd = kFused;

  static reg set1(float x) { return x; }
  static reg add(reg a, reg b) { return a + b; }
  static reg mul(reg a, reg b) { return a * b; }
  // a * b + c: one rounding (like vfmadd) when fused, else two.
  static reg fmadd(reg a, reg b, reg c) {
    if constexpr (kFused) {
      return __builtin_fmaf(a, b, c);  // inlined as vfmadd*ss under the path's target
    } else {
      const float prod = a * b;  // its own statement: not contracted (see the translation units)
      return prod + c;
    }
  }
  static reg div(reg a, reg b) { return a / b; }
  static reg sqrt(reg a) { return __builtin_sqrtf(a); }

  static uint32_t bits_of(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof(u));
    return u;
  }
  static float float_of(uint32_t u) {
    float x;
    __builtin_memcpy(&x, &u, sizeof(x));
    return x;
  }

  static reg load(const float* p) { return *p; }
  static reg load(const bf16_t* p) { return float_of(static_cast<uint32_t>(p->bits) << 16); }
  static reg load(const fp16_t* p) {
    // IEEE half -> single, exact for every input (subnormals, inf, NaN).
    const uint32_t h = p->bits;
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0x1Fu) return float_of(sign | 0x7F800000u | (mant << 13));
    if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0) return float_of(sign);
    // Subnormal half: value = mant * 2^-24, exactly representable in float.
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return float_of(sign | bits_of(mag));
  }

  // --- 8-bit state (adam_q8.h): int32 lanes for the codes
  using ireg = int32_t;
  static reg sub(reg a, reg b) { return a - b; }
  static reg max(reg a, reg b) { return a > b ? a : b; }
  static reg abs(reg a) { return __builtin_fabsf(a); }
  static float hmax(reg a) { return a; }
  static ireg iset1(int32_t x) { return x; }
  static ireg bits(reg a) { return static_cast<int32_t>(bits_of(a)); }
  static reg from_bits(ireg a) { return float_of(static_cast<uint32_t>(a)); }
  static ireg iadd(ireg a, ireg b) { return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b)); }
  static ireg isub(ireg a, ireg b) { return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b)); }
  static ireg iand(ireg a, ireg b) { return a & b; }
  static ireg ior(ireg a, ireg b) { return a | b; }
  static ireg ixor(ireg a, ireg b) { return a ^ b; }
  static ireg imin(ireg a, ireg b) { return a < b ? a : b; }
  static ireg imax(ireg a, ireg b) { return a > b ? a : b; }
  static ireg iabs(ireg a) { return a < 0 ? -a : a; }
  static ireg negate_if_signed(ireg a, ireg s) { return s < 0 ? isub(0, a) : a; }
  template <int k>
  static ireg srl(ireg a) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> k); }
  template <int k>
  static ireg sll(ireg a) { return static_cast<int32_t>(static_cast<uint32_t>(a) << k); }
  template <int k>
  static ireg sra(ireg a) { return a >> k; }  // arithmetic on every compiler this builds with
  static ireg select_ge(reg x, reg t, ireg a, ireg b) { return x >= t ? a : b; }
  static reg select_ge(ireg x, ireg t, reg a, reg b) { return x >= t ? a : b; }
  static ireg select_ge(ireg x, ireg t, ireg a, ireg b) { return x >= t ? a : b; }
  static ireg load(const int8_t* p) { return *p; }
  static ireg load(const uint8_t* p) { return *p; }
  static void store(int8_t* p, ireg x) { *p = static_cast<int8_t>(x); }
  static void store(uint8_t* p, ireg x) { *p = static_cast<uint8_t>(x); }
  static void store(uint16_t* p, ireg x) { *p = static_cast<uint16_t>(x); }
  // Stochastic rounding's noise: lowbias32 (Wellons) of index + key.
  static ireg hash(uint32_t index, uint32_t key) {
    uint32_t x = index + key;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return static_cast<int32_t>(x);
  }

  static void fence_streams() {}
  static void prefetch(const void*) {}

  static void store(float* p, reg x) { *p = x; }
  static void stream(float* p, reg x) { *p = x; }
  static void store(no_out_t*, reg) {}
  static void store(bf16_t* p, reg x) {
    // Round to nearest even; NaN stays a quiet NaN (as torch does).
    const uint32_t u = bits_of(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
      p->bits = 0x7FC0u;
      return;
    }
    p->bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  static constexpr int kGroup = 1;  // no grouped stores: one lane is its own tail
  // A 24-bit master: the float32 whose top 16 bits are *hi's and next 8 *lo, the rest 0.
  static reg load_master24(const bf16_t* hi, const uint8_t* lo) {
    return float_of((static_cast<uint32_t>(hi->bits) << 16) | (static_cast<uint32_t>(*lo) << 8));
  }
  static void store_bits16(bf16_t* p, ireg x) { p->bits = static_cast<uint16_t>(x); }
  static void store(fp16_t* p, reg x) {
    // Single -> half, round to nearest even, overflow to inf, NaN quiet.
    const uint32_t u = bits_of(x);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t abs = u & 0x7FFFFFFFu;
    uint32_t h;
    if (abs > 0x7F800000u) {
      h = 0x7E00u | ((abs >> 13) & 0x3FFu);  // quiet NaN, top payload bits kept (as vcvtps2ph does)
    } else if (abs >= 0x477FF000u) {  // rounds to >= 65520: inf
      h = 0x7C00u;
    } else if (abs >= 0x38800000u) {  // normal half range
      const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
      h = (rounded - 0x38000000u) >> 13;
    } else if (abs > 0x33000000u) {  // subnormal half (above half of 2^-24)
      const uint32_t e = abs >> 23;
      const uint32_t m = (abs & 0x7FFFFFu) | 0x800000u;
      const uint32_t shift = 126u - e;  // 14 + (113 - e) - 1
      const uint32_t keep = m >> shift;
      const uint32_t rem = m & ((1u << shift) - 1u);
      const uint32_t halfway = 1u << (shift - 1u);
      h = keep + ((rem > halfway || (rem == halfway && (keep & 1u))) ? 1u : 0u);
    } else {
      h = 0;  // underflows to (signed) zero; exactly half of 2^-24 ties to even 0
    }
    p->bits = static_cast<uint16_t>(sign | h);
  }
};

// The scalar path: plain multiply then add, portable to CPUs without FMA (where
// a fused multiply-add would be a slow software fmaf) and the same on every CPU.
using VecScalar = VecScalarOf<false>;
