// Per-token dynamic INT8 linear for a few rows (decode steps), AVX-512 VNNI only: the
// int8-dynamic layers' decode rows where oneDNN's per-channel arithmetic is wanted.
//
// y[m, n] = (sum_k q_x[m, k] * w[n, k]) * w_scale[n] * x_scale[m] (+ bias[n]) where q_x is x's
// row m quantized symmetrically to -127..127 with x_scale = max|x[m]| / 127, rounded half up.
// The arithmetic is the one of quantize.py's oneDNN path, operation for operation, so the output is
// bit-identical to it (tested): the integer products are exact, and every float step rounds as
// the PyTorch operator it replaces does. Elsewhere that path itself runs (the same outputs).
//
// q_x is stored as q_x + 128 (uint8) for vpdpbusd (u8 x s8 -> s32); the 128 * sum_k w[n, k] this
// adds is taken off with the per-row weight sums passed in.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

#define ISA_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma"
#include "isa_begin.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

// Row x [k_size] to uint8 (q + 128) and its scale, as quantize.py's _token_scales + addcmul + copy_.
void quantize_row(const float* x, int64_t k_size, uint8_t* q, float* scale) {
  __m512 vmax = _mm512_set1_ps(-INFINITY), vmin = _mm512_set1_ps(INFINITY);
  int64_t k = 0;
  for (; k + 16 <= k_size; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    vmax = _mm512_max_ps(vmax, v);
    vmin = _mm512_min_ps(vmin, v);
  }
  float amax = _mm512_reduce_max_ps(vmax), amin = _mm512_reduce_min_ps(vmin);
  for (; k < k_size; ++k) {
    amax = std::max(amax, x[k]);
    amin = std::min(amin, x[k]);
  }
  float absmax = std::max(std::max(amax, -amin), 127e-12f);
  *scale = absmax / 127.0f;
  const float inv = (1.0f / absmax) * 127.0f;
  for (k = 0; k < k_size; ++k) {
    // addcmul(128.5, x, inv): 128.5 + x * inv in one fused multiply-add, as PyTorch's kernel does.
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::fma(x[k], inv, 128.5f)));
  }
}

// Integer dot products of ROWS weight rows (from n) with M_TILE quantized x rows (from m).
template <int ROWS, int M_TILE>
void dot_tile(const int8_t* w, int64_t k_size, const uint8_t* qx, int64_t n, int64_t m, int64_t m_count,
              int32_t* out /* [m_count][ROWS] */) {
  __m512i acc[ROWS][M_TILE];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < M_TILE; ++j) acc[r][j] = _mm512_setzero_si512();
  const int8_t* rows[ROWS];
  for (int r = 0; r < ROWS; ++r) rows[r] = w + (n + r) * k_size;
  int64_t k = 0;
  for (; k + 64 <= k_size; k += 64) {
    __m512i xv[M_TILE];
    for (int j = 0; j < M_TILE; ++j)
      xv[j] = j < m_count ? _mm512_loadu_si512(qx + (m + j) * k_size + k) : _mm512_setzero_si512();
    for (int r = 0; r < ROWS; ++r) {
      __m512i wv = _mm512_loadu_si512(rows[r] + k);
      for (int j = 0; j < M_TILE; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv[j], wv);
    }
  }
  if (k < k_size) {
    const __mmask64 mask = (~0ULL) >> (64 - (k_size - k));
    __m512i xv[M_TILE];
    for (int j = 0; j < M_TILE; ++j)
      xv[j] = j < m_count ? _mm512_maskz_loadu_epi8(mask, qx + (m + j) * k_size + k) : _mm512_setzero_si512();
    for (int r = 0; r < ROWS; ++r) {
      __m512i wv = _mm512_maskz_loadu_epi8(mask, rows[r] + k);
      for (int j = 0; j < M_TILE; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv[j], wv);
    }
  }
  for (int j = 0; j < M_TILE && j < m_count; ++j)
    for (int r = 0; r < ROWS; ++r) out[j * ROWS + r] = _mm512_reduce_add_epi32(acc[r][j]);
}

float finish(const GemvLinear& l, const float* x_scale, int32_t dot, int64_t row, int64_t col) {
  const float v = static_cast<float>(dot - 128 * l.weight_sum[col]) * l.weight_scale[col];
  return l.bias ? std::fma(v, x_scale[row], l.bias[col]) : v * x_scale[row];
}

}  // namespace

void gemv_quantize_avx512(const GemvLinear& l, uint8_t* qx, float* x_scale) {
  for (int64_t m = 0; m < l.m_size; ++m) quantize_row(l.x + m * l.k_size, l.k_size, qx + m * l.k_size, x_scale + m);
}

void gemv_tiles_avx512(const GemvLinear& l, const uint8_t* qx, const float* x_scale, int64_t tile_begin,
                       int64_t tile_end) {
  constexpr int64_t kRows = kGemvTileRows;
  int32_t dots[kGemvMaxRows * kRows];
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t n = t * kRows, rows = std::min(kRows, l.n_size - n);
    for (int64_t m = 0; m < l.m_size; m += 4) {
      const int64_t count = std::min<int64_t>(4, l.m_size - m);
      if (rows == kRows) {
        switch (count) {  // as many accumulators as rows of x: no product of a missing row
          case 1: dot_tile<kRows, 1>(l.weight, l.k_size, qx, n, m, count, dots); break;
          case 2: dot_tile<kRows, 2>(l.weight, l.k_size, qx, n, m, count, dots); break;
          case 3: dot_tile<kRows, 3>(l.weight, l.k_size, qx, n, m, count, dots); break;
          default: dot_tile<kRows, 4>(l.weight, l.k_size, qx, n, m, count, dots);
        }
        for (int64_t j = 0; j < count; ++j)
          for (int64_t r = 0; r < kRows; ++r)
            l.y[(m + j) * l.n_size + n + r] = finish(l, x_scale, dots[j * kRows + r], m + j, n + r);
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          dot_tile<1, 4>(l.weight, l.k_size, qx, n + r, m, count, dots);
          for (int64_t j = 0; j < count; ++j) l.y[(m + j) * l.n_size + n + r] = finish(l, x_scale, dots[j], m + j, n + r);
        }
      }
    }
  }
}
#else
void gemv_quantize_avx512(const GemvLinear&, uint8_t*, float*) {}
void gemv_tiles_avx512(const GemvLinear&, const uint8_t*, const float*, int64_t, int64_t) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
