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

// One row (a decode step: bound by reading the weights, so the fewest operations per weight byte):
// |q_x| broadcast against q_w with q_x's sign, one operation fewer per weight vector than the
// rows' form (no |q_w|). q_w is in -127..127 (kernels.check_block_weight refuses -128, which
// vpsignb cannot negate), so each pair sum is at most 2 * 127 * 127 < 32767, exact.
template <int NR>
void row_tile(const BlockLinear& l, const BlockActivations& a, int64_t t) {
  const int64_t groups = a.k_pad / 4;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 facc[NR][2];
  for (int r = 0; r < NR; ++r) facc[r][0] = facc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256i acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t g = b * (kBlock / 4); g < (b + 1) * (kBlock / 4); ++g) {
      int32_t four;
      std::memcpy(&four, a.q + g * 4, sizeof four);
      const __m256i xv = _mm256_set1_epi32(four), xabs = _mm256_abs_epi8(xv);
      for (int r = 0; r < NR; ++r)
        for (int h = 0; h < 2; ++h) {
          const __m256i raw =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l.weight + ((t + r) * groups + g) * 64 + 32 * h));
          const __m256i pairs = _mm256_maddubs_epi16(xabs, _mm256_sign_epi8(_mm256_xor_si256(raw, flip), xv));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
        }
    }
    const __m256 xs = _mm256_set1_ps(a.scale[b]);
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(l.weight_scale + ((t + r) * a.blocks + b) * kLanes + 8 * h), xs);
        facc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), s, facc[r][h]);
      }
  }
  for (int r = 0; r < NR; ++r) {
    alignas(32) float out[kLanes];
    _mm256_store_ps(out, facc[r][0]);
    _mm256_store_ps(out + 8, facc[r][1]);
    const int64_t n0 = (t + r) * kLanes, count = std::min(kLanes, l.n_size - n0);
    for (int64_t i = 0; i < count; ++i) l.y[n0 + i] = l.bias ? out[i] + l.bias[n0 + i] : out[i];
  }
}

// Sixteen 256-bit registers: four rows of one tile keep their 8 accumulators, the tile's 4 weight
// vectors and the broadcast x in registers (more rows or tiles spill); a row alone takes both
// tiles of the step, for two independent weight streams.
template <int NR>
void rows_of_tiles(const BlockLinear& l, const BlockActivations& a, int64_t t) {
  if (l.m_size == 1) {
    row_tile<NR>(l, a, t);
    return;
  }
  for (int r = 0; r < NR; ++r) {
    int64_t m = 0;
    for (; m + 4 <= l.m_size; m += 4) block_tile<4, 1>(l, a, m, t + r);
    switch (l.m_size - m) {
      case 3: block_tile<3, 1>(l, a, m, t + r); break;
      case 2: block_tile<2, 1>(l, a, m, t + r); break;
      case 1: block_tile<1, 1>(l, a, m, t + r); break;
      default: break;
    }
  }
}

}  // namespace

void quantize_blocks_avx2(const float* x, int64_t k_size, const BlockActivations& a, int64_t row) {
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' 128-bit interleave
  int8_t* q = a.q + row * a.k_pad;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t k0 = b * kBlock, valid = std::min(kBlock, k_size - k0);
    __m256 v[4];
    __m256 amax_v = _mm256_setzero_ps(), nan_v = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      // lanes past k_size load as 0 (and are never read)
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid - 8 * i)), lane);
      v[i] = _mm256_maskload_ps(x + k0 + 8 * i, live);
      nan_v = _mm256_or_ps(nan_v, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      amax_v = _mm256_max_ps(amax_v, _mm256_and_ps(v[i], sign_off));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax_v);
    float amax = 0.0f;
    for (float l : lanes) amax = std::max(amax, l);
    if (_mm256_movemask_ps(nan_v) != 0) amax = NAN;  // a NaN makes the scale NaN (max_ps would drop it)
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;  // NaN > 0 is false
    const __m256 vinv = _mm256_set1_ps(inv);
    // round half to even (the default rounding mode); NaN and out of range give INT32_MIN, then
    // saturated to -127..127 as the portable path does
    const __m256i floor = _mm256_set1_epi32(-127);
    __m256i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)), floor);
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), bytes);
    a.scale[row * a.blocks + b] = amax / 127.0f;
    int32_t sum = 0;  // of the saturated int8 values (what the dot products see)
    for (int64_t i = 0; i < kBlock; ++i) sum += q[k0 + i];
    a.sum[row * a.blocks + b] = sum;
  }
}

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
void quantize_blocks_avx2(const float*, int64_t, const BlockActivations&, int64_t) {}
void block_steps_avx2(const BlockLinear&, const BlockActivations&, int64_t, int64_t) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
