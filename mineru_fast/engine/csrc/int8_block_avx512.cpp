// Block-wise INT8 linear, AVX-512 VNNI path (arithmetic: kernels.h).
//
// vpdpbusd (u8 x s8 -> s32) with the unsigned weights (q_w + 128) and 4 int8 values of x
// broadcast adds all 16 outputs' products of 4 k at once; the 128 * sum(q_x) this adds to each
// block is taken off by starting the block's sum at its negative.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#define ISA_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma"
#include "isa_begin.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

__mmask16 lane_mask(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// Outputs of MR rows (from m) and NR weight tiles (from tile t), written to y (bias added).
template <int MR, int NR>
void block_tile(const BlockLinear& l, const BlockActivations& a, int64_t m, int64_t t) {
  const int64_t groups = a.k_pad / 4;
  __m512 facc[MR][NR];
  for (int j = 0; j < MR; ++j)
    for (int r = 0; r < NR; ++r) facc[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m512i acc[MR][NR];  // each starts at -128 * sum(q_x): what the + 128 of the weights adds
    for (int j = 0; j < MR; ++j) {
      const __m512i start = _mm512_set1_epi32(-128 * a.sum[(m + j) * a.blocks + b]);
      for (int r = 0; r < NR; ++r) acc[j][r] = start;
    }
    // unrolled whole (kBlock / 4 = 8 groups): GCC otherwise keeps the accumulators in a rotating
    // chain of register copies
    static_assert(kBlock / 4 == 8, "the unroll count below is kBlock / 4");
#pragma GCC unroll 8
    for (int64_t g = b * (kBlock / 4); g < (b + 1) * (kBlock / 4); ++g) {
      __m512i wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_si512(l.weight + ((t + r) * groups + g) * 64);
      for (int j = 0; j < MR; ++j) {
        int32_t four;
        std::memcpy(&four, a.q + (m + j) * a.k_pad + g * 4, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_dpbusd_epi32(acc[j][r], wv[r], xv);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 wsv = _mm512_loadu_ps(l.weight_scale + ((t + r) * a.blocks + b) * kLanes);
      for (int j = 0; j < MR; ++j) {
        const __m512 s = _mm512_mul_ps(wsv, _mm512_set1_ps(a.scale[(m + j) * a.blocks + b]));
        facc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][r]), s, facc[j][r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int64_t n0 = (t + r) * kLanes;
    const __mmask16 mask = lane_mask(l.n_size - n0);
    const __m512 bv = l.bias ? _mm512_maskz_loadu_ps(mask, l.bias + n0) : _mm512_setzero_ps();
    for (int j = 0; j < MR; ++j) {
      const __m512 v = l.bias ? _mm512_add_ps(facc[j][r], bv) : facc[j][r];
      _mm512_mask_storeu_ps(l.y + (m + j) * l.n_size + n0, mask, v);
    }
  }
}

template <int NR>
void rows_of_tiles(const BlockLinear& l, const BlockActivations& a, int64_t t) {
  int64_t m = 0;
  for (; m + 4 <= l.m_size; m += 4) block_tile<4, NR>(l, a, m, t);
  switch (l.m_size - m) {
    case 3: block_tile<3, NR>(l, a, m, t); break;
    case 2: block_tile<2, NR>(l, a, m, t); break;
    case 1: block_tile<1, NR>(l, a, m, t); break;
    default: break;
  }
}

}  // namespace

void quantize_blocks_avx512(const float* x, int64_t k_size, const BlockActivations& a, int64_t row) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  int8_t* q = a.q + row * a.k_pad;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t k0 = b * kBlock, valid = std::min(kBlock, k_size - k0);
    const __m512 lo = _mm512_maskz_loadu_ps(lane_mask(valid), x + k0);
    const __m512 hi = _mm512_maskz_loadu_ps(lane_mask(std::max<int64_t>(valid - kLanes, 0)), x + k0 + kLanes);
    // a NaN makes the block's scale NaN, so it reaches the outputs (max_ps would drop it)
    const bool nan = (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) != 0;
    const float amax =
        nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;  // NaN > 0 is false
    const __m512 vinv = _mm512_set1_ps(inv);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q_lo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, vinv), kRound);
    const __m512i q_hi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, vinv), kRound);
    // saturated to -127..127 (only a NaN, or a block whose 127 / max overflows, reaches the bounds)
    const __m512i floor = _mm512_set1_epi32(-127);
    const __m128i b_lo = _mm512_cvtsepi32_epi8(_mm512_max_epi32(q_lo, floor));
    const __m128i b_hi = _mm512_cvtsepi32_epi8(_mm512_max_epi32(q_hi, floor));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), b_lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + kLanes), b_hi);
    a.scale[row * a.blocks + b] = amax / 127.0f;
    // the sum of the saturated int8 values (what the dot products see)
    a.sum[row * a.blocks + b] =
        _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_cvtepi8_epi32(b_lo), _mm512_cvtepi8_epi32(b_hi)));
  }
}

void block_steps_avx512(const BlockLinear& l, const BlockActivations& a, int64_t step_begin, int64_t step_end) {
  for (int64_t step = step_begin; step < step_end; ++step) {
    const int64_t t = step * kStepTiles;
    if (t + kStepTiles <= l.tiles)
      rows_of_tiles<kStepTiles>(l, a, t);
    else
      rows_of_tiles<1>(l, a, t);
  }
}
#else
void quantize_blocks_avx512(const float*, int64_t, const BlockActivations&, int64_t) {}
void block_steps_avx512(const BlockLinear&, const BlockActivations&, int64_t, int64_t) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
