// Block-wise INT8 linear, AVX2 + FMA path (arithmetic: kernels.h; the same integers and float
// steps as the AVX-512 VNNI path, so the same bits).
//
// Without VNNI the 4-k products of 16 outputs come from vpmaddubsw + vpmaddwd. vpmaddubsw
// multiplies unsigned by signed bytes and saturates its int16 pair sums, so it is fed |q_w| and
// q_x with q_w's sign (vpsignb): each pair sum is at most 2 * 128 * 127 = 32512 < 32767, exact.
// vpmaddwd against ones then adds the pairs into the int32 sum of each output's 4 k.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#define ISA_TARGET "avx2,fma"
#include "isa_begin.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

// Outputs of MR rows (from m) and NR weight tiles (from tile t); each tile is two 8-lane halves.
template <int MR, int NR>
void block_tile(const BlockLinear& l, const BlockActivations& a, int64_t m, int64_t t) {
  const int64_t groups = a.k_pad / 4;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  alignas(32) float facc[MR][NR][kLanes] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256i acc[MR][NR][2];
    for (int j = 0; j < MR; ++j)
      for (int r = 0; r < NR; ++r) acc[j][r][0] = acc[j][r][1] = _mm256_setzero_si256();
    for (int64_t g = b * (kBlock / 4); g < (b + 1) * (kBlock / 4); ++g) {
      __m256i wabs[NR][2], wsgn[NR][2];
      for (int r = 0; r < NR; ++r)
        for (int h = 0; h < 2; ++h) {
          const __m256i raw =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l.weight + ((t + r) * groups + g) * 64 + 32 * h));
          wsgn[r][h] = _mm256_xor_si256(raw, flip);  // q_w as int8
          wabs[r][h] = _mm256_abs_epi8(wsgn[r][h]);
        }
      for (int j = 0; j < MR; ++j) {
        int32_t four;
        std::memcpy(&four, a.q + (m + j) * a.k_pad + g * 4, sizeof four);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int r = 0; r < NR; ++r)
          for (int h = 0; h < 2; ++h) {
            const __m256i pairs = _mm256_maddubs_epi16(wabs[r][h], _mm256_sign_epi8(xv, wsgn[r][h]));
            acc[j][r][h] = _mm256_add_epi32(acc[j][r][h], _mm256_madd_epi16(pairs, ones));
          }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m256 wsv = _mm256_loadu_ps(l.weight_scale + ((t + r) * a.blocks + b) * kLanes + 8 * h);
        for (int j = 0; j < MR; ++j) {
          const __m256 s = _mm256_mul_ps(wsv, _mm256_set1_ps(a.scale[(m + j) * a.blocks + b]));
          float* out = facc[j][r] + 8 * h;
          _mm256_store_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][r][h]), s, _mm256_load_ps(out)));
        }
      }
  }
  for (int r = 0; r < NR; ++r) {
    const int64_t n0 = (t + r) * kLanes, count = std::min(kLanes, l.n_size - n0);
    for (int j = 0; j < MR; ++j) {
      float* y = l.y + (m + j) * l.n_size + n0;
      for (int64_t i = 0; i < count; ++i) y[i] = l.bias ? facc[j][r][i] + l.bias[n0 + i] : facc[j][r][i];
    }
  }
}

template <int NR>
void rows_of_tiles(const BlockLinear& l, const BlockActivations& a, int64_t t) {
  int64_t m = 0;
  for (; m + 2 <= l.m_size; m += 2) block_tile<2, NR>(l, a, m, t);
  if (m < l.m_size) block_tile<1, NR>(l, a, m, t);
}

}  // namespace

void block_steps_avx2(const BlockLinear& l, const BlockActivations& a, int64_t step_begin, int64_t step_end) {
  for (int64_t step = step_begin; step < step_end; ++step) {
    const int64_t t = step * kStepTiles;
    if (t + kStepTiles <= l.tiles)
      rows_of_tiles<kStepTiles>(l, a, t);
    else
      rows_of_tiles<1>(l, a, t);
  }
}
#else
void block_steps_avx2(const BlockLinear&, const BlockActivations&, int64_t, int64_t) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
