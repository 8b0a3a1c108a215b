// Eight float lanes: AVX2 + FMA + F16C.
#pragma once

#include <immintrin.h>

struct VecAvx2 {
  using reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr bool kFusedMultiplyAdd = true;  // fmadd is one vfmadd: a single rounding

  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }

  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg load(const fp16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  // --- 8-bit state (adam_q8.h): int32 lanes for the codes
  using ireg = __m256i;
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg abs(reg a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static float hmax(reg a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static ireg iset1(int32_t x) { return _mm256_set1_epi32(x); }
  static ireg bits(reg a) { return _mm256_castps_si256(a); }
  static reg from_bits(ireg a) { return _mm256_castsi256_ps(a); }
  static ireg iadd(ireg a, ireg b) { return _mm256_add_epi32(a, b); }
  static ireg isub(ireg a, ireg b) { return _mm256_sub_epi32(a, b); }
  static ireg iand(ireg a, ireg b) { return _mm256_and_si256(a, b); }
  static ireg ior(ireg a, ireg b) { return _mm256_or_si256(a, b); }
  static ireg ixor(ireg a, ireg b) { return _mm256_xor_si256(a, b); }
  static ireg imin(ireg a, ireg b) { return _mm256_min_epi32(a, b); }
  static ireg imax(ireg a, ireg b) { return _mm256_max_epi32(a, b); }
  static ireg iabs(ireg a) { return _mm256_abs_epi32(a); }
  // -a where s's sign bit is set, else a (psignd's zero for s == 0 gives the same: a is 0 there)
  static ireg negate_if_signed(ireg a, ireg s) { return _mm256_sign_epi32(a, s); }
  template <int k>
  static ireg srl(ireg a) { return _mm256_srli_epi32(a, k); }
  template <int k>
  static ireg sll(ireg a) { return _mm256_slli_epi32(a, k); }
  template <int k>
  static ireg sra(ireg a) { return _mm256_srai_epi32(a, k); }
  // x >= t ? a : b, for float x and int lanes, and for int x and float lanes
  static ireg select_ge(reg x, reg t, ireg a, ireg b) {
    const reg ge = _mm256_cmp_ps(x, t, _CMP_GE_OQ);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(a), ge));
  }
  static reg select_ge(ireg x, ireg t, reg a, reg b) {
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(t, x)));
  }
  static ireg select_ge(ireg x, ireg t, ireg a, ireg b) { return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi32(t, x)); }
  static ireg load(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static ireg load(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static __m128i words(ireg x) { return _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)); }
  static void store(int8_t* p, ireg x) {
    const __m128i w = words(x);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static void store(uint8_t* p, ireg x) {
    const __m128i w = words(x);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  // lanes in [0, 0xFFFF]: the unsigned saturation keeps them
  static void store(uint16_t* p, ireg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
  }
  static ireg hash(uint32_t index, uint32_t key) {
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index + key)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }

  static void fence_streams() { _mm_sfence(); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  // See VecAvx512::stream.
  static void stream(float* p, reg x) {
    if (kStreamingStores && (reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_ps(p, x);
    } else {
      _mm256_storeu_ps(p, x);
    }
  }
  static void store(no_out_t*, reg) {}
  static void store(bf16_t* p, reg x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), is_nan);
    // Pack 8 x u32 (all <= 0xFFFF) into 8 x u16; packus works per 128-bit lane.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    store_bits(p, _mm256_castsi256_si128(packed));
  }
  // --- kGroup vectors' narrow stores at once (see VecAvx512::store_group): packs within 128-bit lanes, then one
  // permutation.
  static constexpr int kGroup = 4;
  static __m256i in_order_dwords(__m256i x) {  // lane k, dword j (register j's elements 4k..4k+3) -> dword 2j + k
    return _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  static void store_group(int8_t* p, const ireg (&x)[kGroup]) {
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(x[0], x[1]), _mm256_packs_epi32(x[2], x[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), in_order_dwords(w));
  }
  static void store_group(uint8_t* p, const ireg (&x)[kGroup]) {
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(x[0], x[1]), _mm256_packus_epi32(x[2], x[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), in_order_dwords(w));
  }
  static void store_group(uint16_t* p, const ireg (&x)[kGroup]) {
    for (int k = 0; k < kGroup; k += 2) {
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(x[k], x[k + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8 * k), w);
    }
  }
  static void store_group_bits16(bf16_t* p, const ireg (&x)[kGroup]) {
    for (int k = 0; k < kGroup; k += 2) {
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(x[k], x[k + 1]), 0xD8);
      if (kStreamingStores && (reinterpret_cast<uintptr_t>(p + 8 * k) & 31) == 0) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 8 * k), w);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8 * k), w);
      }
    }
  }

  // A 24-bit master: the float32 whose top 16 bits are hi's (a bfloat16) and next 8 lo's, the rest 0.
  static reg load_master24(const bf16_t* hi, const uint8_t* lo) {
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(load(hi)), _mm256_slli_epi32(load(lo), 8)));
  }

  // 16-bit patterns held in int32 lanes (each <= 0xFFFF), stored as a copy is.
  static void store_bits16(bf16_t* p, ireg x) {
    store_bits(p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x08)));
  }
  static void store(fp16_t* p, reg x) { store_bits(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }

  // See VecAvx512::store_bits.
  static constexpr int kOutAlign = 16;
  template <class T>
  static void store_bits(T* p, __m128i bits) {
    if (kStreamingStores && (reinterpret_cast<uintptr_t>(p) & (kOutAlign - 1)) == 0) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), bits);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits);
    }
  }
};
