// Sixteen float lanes: AVX-512 F/BW/VL + FMA.
#pragma once

#include <immintrin.h>

struct VecAvx512 {
  using reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr bool kFusedMultiplyAdd = true;  // fmadd is one vfmadd: a single rounding

  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }

  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const bf16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg load(const fp16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  // --- 8-bit state (adam_q8.h): int32 lanes for the codes
  using ireg = __m512i;
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg abs(reg a) { return _mm512_abs_ps(a); }
  static float hmax(reg a) { return _mm512_reduce_max_ps(a); }
  static ireg iset1(int32_t x) { return _mm512_set1_epi32(x); }
  static ireg bits(reg a) { return _mm512_castps_si512(a); }
  static reg from_bits(ireg a) { return _mm512_castsi512_ps(a); }
  static ireg iadd(ireg a, ireg b) { return _mm512_add_epi32(a, b); }
  static ireg isub(ireg a, ireg b) { return _mm512_sub_epi32(a, b); }
  static ireg iand(ireg a, ireg b) { return _mm512_and_si512(a, b); }
  static ireg ior(ireg a, ireg b) { return _mm512_or_si512(a, b); }
  static ireg ixor(ireg a, ireg b) { return _mm512_xor_si512(a, b); }
  static ireg imin(ireg a, ireg b) { return _mm512_min_epi32(a, b); }
  static ireg imax(ireg a, ireg b) { return _mm512_max_epi32(a, b); }
  static ireg iabs(ireg a) { return _mm512_abs_epi32(a); }
  // -a where s's sign bit is set, else a
  static ireg negate_if_signed(ireg a, ireg s) {
    return _mm512_mask_sub_epi32(a, _mm512_movepi32_mask(s), _mm512_setzero_si512(), a);
  }
  template <int k>
  static ireg srl(ireg a) { return _mm512_srli_epi32(a, k); }
  template <int k>
  static ireg sll(ireg a) { return _mm512_slli_epi32(a, k); }
  template <int k>
  static ireg sra(ireg a) { return _mm512_srai_epi32(a, k); }
  // x >= t ? a : b, for float x and int lanes, and for int x and float lanes
  static ireg select_ge(reg x, reg t, ireg a, ireg b) {
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, t, _CMP_GE_OQ), b, a);
  }
  static reg select_ge(ireg x, ireg t, reg a, reg b) { return _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(x, t), b, a); }
  static ireg select_ge(ireg x, ireg t, ireg a, ireg b) {
    return _mm512_mask_blend_epi32(_mm512_cmpge_epi32_mask(x, t), b, a);
  }
  static ireg load(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static ireg load(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(int8_t* p, ireg x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static void store(uint8_t* p, ireg x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static void store(uint16_t* p, ireg x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x)); }
  // Stochastic rounding's noise: lowbias32 of index + lane + key (see VecScalarOf::hash).
  static ireg hash(uint32_t index, uint32_t key) {
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index + key)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }

  static void fence_streams() { _mm_sfence(); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  // For data written and not read back soon (a rollback backup): no read-for-ownership where aligned.
  static void stream(float* p, reg x) {
    if (kStreamingStores && (reinterpret_cast<uintptr_t>(p) & 63) == 0) {
      _mm512_stream_ps(p, x);
    } else {
      _mm512_storeu_ps(p, x);
    }
  }
  static void store(no_out_t*, reg) {}
  static void store(bf16_t* p, reg x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i out = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(0x7FC0));
    store_bits(p, _mm512_cvtepi32_epi16(out));
  }
  // --- kGroup vectors' narrow stores at once (adam_q8.h's pass 2): packs over two or four registers cost one
  // instruction a register where a register's own narrowing store costs two. The packs work within 128-bit
  // lanes; one permutation puts each register's elements back in order. Lanes must already be in range (codes,
  // bytes 0..255, 16-bit patterns 0..0xFFFF): packs saturate where the narrowing stores truncate.
  static constexpr int kGroup = 4;
  static __m512i in_order_dwords(__m512i x) {  // lane k, dword j (register j's elements 4k..4k+3) -> dword 4j + k
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
  }
  static __m512i in_order_qwords(__m512i x) {  // lane k, qword j (register j's elements 4k..4k+3) -> qword 4j + k
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), x);
  }
  static void store_group(int8_t* p, const ireg (&x)[kGroup]) {
    const __m512i w = _mm512_packs_epi16(_mm512_packs_epi32(x[0], x[1]), _mm512_packs_epi32(x[2], x[3]));
    _mm512_storeu_si512(p, in_order_dwords(w));
  }
  static void store_group(uint8_t* p, const ireg (&x)[kGroup]) {
    const __m512i w = _mm512_packus_epi16(_mm512_packus_epi32(x[0], x[1]), _mm512_packus_epi32(x[2], x[3]));
    _mm512_storeu_si512(p, in_order_dwords(w));
  }
  static void store_group(uint16_t* p, const ireg (&x)[kGroup]) {
    _mm512_storeu_si512(p, in_order_qwords(_mm512_packus_epi32(x[0], x[1])));
    _mm512_storeu_si512(p + 32, in_order_qwords(_mm512_packus_epi32(x[2], x[3])));
  }
  static void store_group_bits16(bf16_t* p, const ireg (&x)[kGroup]) {
    for (int k = 0; k < kGroup; k += 2) {
      const __m512i w = in_order_qwords(_mm512_packus_epi32(x[k], x[k + 1]));
      if (kStreamingStores && (reinterpret_cast<uintptr_t>(p + 16 * k) & 63) == 0) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(p + 16 * k), w);
      } else {
        _mm512_storeu_si512(p + 16 * k, w);
      }
    }
  }

  // A 24-bit master: the float32 whose top 16 bits are hi's (a bfloat16) and next 8 lo's, the rest 0. The 16
  // bytes of lo are broadcast to the four 128-bit lanes, and a byte shuffle writes lane k's four (4k..4k+3) into
  // byte 1 of its dwords under a byte mask, the other bytes kept from hi's: no shift, no OR.
  static reg load_master24(const bf16_t* hi, const uint8_t* lo) {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
    // the shuffle's index for byte 1 of lane k's dword j: lo's byte 4k + j (dword 4k + j of the whole register)
    const __m512i index = _mm512_setr_epi32(0x000, 0x100, 0x200, 0x300, 0x400, 0x500, 0x600, 0x700, 0x800, 0x900,
                                            0xA00, 0xB00, 0xC00, 0xD00, 0xE00, 0xF00);
    return _mm512_castsi512_ps(_mm512_mask_shuffle_epi8(_mm512_castps_si512(load(hi)), 0x2222222222222222ull, bytes, index));
  }

  // 16-bit patterns held in int32 lanes (each <= 0xFFFF), stored as a copy is.
  static void store_bits16(bf16_t* p, ireg x) { store_bits(p, _mm512_cvtepi32_epi16(x)); }
  static void store(fp16_t* p, reg x) { store_bits(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }

  // The low-precision copy is written and never read here: where it is
  // aligned, a streaming store skips the read-for-ownership of its lines.
  static constexpr int kOutAlign = 32;
  template <class T>
  static void store_bits(T* p, __m256i bits) {
    if (kStreamingStores && (reinterpret_cast<uintptr_t>(p) & (kOutAlign - 1)) == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bits);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
    }
  }
};
