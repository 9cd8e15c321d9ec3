// Per-channel INT8 GEMM for CPUs without VNNI (AVX2 + FMA): the vision encoder's linears on the avx2
// path, oneDNN's outputs bit for bit (kernels.h states the arithmetic). oneDNN's AVX2 GEMM and this
// one multiply with the same instructions; this one also applies the row scales and the bias as it
// writes the outputs, where the oneDNN path takes another pass over them.
//
// A micro-tile is 2 rows by one 32-output panel: 8 int32 accumulators; per 4 k, 4 weight vectors,
// 2 broadcasts of 4 activation bytes and 8 x (vpmaddubsw, vpmaddwd against ones, vpaddd). A work
// item is up to 192 rows (the vision MLP's chunk: each weight panel comes from memory once per
// chunk; with 48-row items it came 4 times, and a thread ran 0.67x as fast) by 2 panels, so the
// threads split the outputs of every call. k goes in passes of at most kGemmDepth, so a panel's
// slice of weights (32 x 1,536 bytes at most) stays in L1 while the rows go by.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#define ISA_TARGET "avx2,fma"
#include "isa_begin.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

constexpr int kVectors = kGemmPanel / 8;  // int32 vectors per row of a panel

// acc[MR][32] (+)= the int32 products of rows x[0..MR) (rows ldx apart) and a panel's weights w,
// over `depth` k (a multiple of 4) from the pointers given.
template <int MR>
void micro_tile(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t depth, bool first, int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum[MR][kVectors];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kVectors; ++j)
      sum[i][j] = first ? _mm256_setzero_si256()
                        : _mm256_load_si256(reinterpret_cast<const __m256i*>(acc + i * kGemmPanel + 8 * j));
  for (int64_t g = 0; g < depth / 4; ++g) {
    __m256i wv[kVectors];
    for (int j = 0; j < kVectors; ++j)
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 4 * kGemmPanel + 32 * j));
    for (int i = 0; i < MR; ++i) {
      int32_t four;
      std::memcpy(&four, x + i * ldx + g * 4, sizeof four);
      const __m256i xv = _mm256_set1_epi32(four);
      for (int j = 0; j < kVectors; ++j)
        sum[i][j] = _mm256_add_epi32(sum[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wv[j]), ones));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kVectors; ++j)
      _mm256_store_si256(reinterpret_cast<__m256i*>(acc + i * kGemmPanel + 8 * j), sum[i][j]);
}

// out[0..32) = the outputs of row m for the 32 outputs from n0, from their int32 sums (kernels.h's
// float steps); ws and bias (or nullptr) point at those outputs' scales and biases.
inline void finish_row(const PerChannelGemm& g, int64_t m, int64_t n0, const int32_t* acc, const float* ws,
                       const float* bias, float* out) {
  const __m256 xs = _mm256_set1_ps(g.x_scale[m]);
  for (int j = 0; j < kVectors; ++j) {
    const __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.weight_offset + n0 + 8 * j));
    const __m256i s = _mm256_sub_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc + 8 * j)), offset);
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_loadu_ps(ws + 8 * j));
    _mm256_storeu_ps(out + 8 * j, bias ? _mm256_fmadd_ps(v, xs, _mm256_loadu_ps(bias + 8 * j)) : _mm256_mul_ps(v, xs));
  }
}

// The outputs of row m and panel p. A partial last panel reads the scales and biases (n_size values)
// and writes its outputs through zero-filled copies.
void write_row(const PerChannelGemm& g, int64_t m, int64_t p, const int32_t* acc) {
  const int64_t n0 = p * kGemmPanel, count = std::min(kGemmPanel, g.n_size - n0);
  const float* bias = g.bias ? g.bias + n0 : nullptr;
  float* y = g.y + m * g.n_size + n0;
  if (count == kGemmPanel) {
    finish_row(g, m, n0, acc, g.weight_scale + n0, bias, y);
    return;
  }
  alignas(32) float ws_tail[kGemmPanel] = {}, bias_tail[kGemmPanel] = {}, y_tail[kGemmPanel];
  std::memcpy(ws_tail, g.weight_scale + n0, count * sizeof(float));
  if (bias) std::memcpy(bias_tail, bias, count * sizeof(float));
  finish_row(g, m, n0, acc, ws_tail, bias ? bias_tail : nullptr, y_tail);
  std::memcpy(y, y_tail, count * sizeof(float));
}

// Rows [m, m + MR) of one panel over every k in one pass, written as they are done.
template <int MR>
void rows_in_one_pass(const PerChannelGemm& g, int64_t m, int64_t p, const int8_t* panel) {
  alignas(32) int32_t acc[MR * kGemmPanel];
  micro_tile<MR>(g.x + m * g.k_size, g.k_size, panel, g.k_size, true, acc);
  for (int i = 0; i < MR; ++i) write_row(g, m + i, p, acc + i * kGemmPanel);
}

}  // namespace

void per_channel_gemm_avx2(const PerChannelGemm& g, int64_t row_begin, int64_t row_end, int64_t panel_begin,
                           int64_t panel_end) {
  const int64_t passes = (g.k_size + kGemmDepth - 1) / kGemmDepth;
  const int64_t depth = (g.k_size / 4 + passes - 1) / passes * 4;  // equal passes, multiples of 4 k
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const int8_t* panel = g.weight + p * g.k_size * kGemmPanel;
    if (passes == 1) {  // no sums to keep between passes: each micro-tile is written at once
      int64_t m = row_begin;
      for (; m + 2 <= row_end; m += 2) rows_in_one_pass<2>(g, m, p, panel);
      if (m < row_end) rows_in_one_pass<1>(g, m, p, panel);
      continue;
    }
    alignas(32) int32_t acc[kGemmRowBlock * kGemmPanel];
    for (int64_t k0 = 0; k0 < g.k_size; k0 += depth) {
      const int64_t d = std::min(depth, g.k_size - k0);
      const int8_t* w = panel + k0 * kGemmPanel;
      int64_t m = row_begin;
      for (; m + 2 <= row_end; m += 2)
        micro_tile<2>(g.x + m * g.k_size + k0, g.k_size, w, d, k0 == 0, acc + (m - row_begin) * kGemmPanel);
      if (m < row_end)
        micro_tile<1>(g.x + m * g.k_size + k0, g.k_size, w, d, k0 == 0, acc + (m - row_begin) * kGemmPanel);
    }
    for (int64_t m = row_begin; m < row_end; ++m) write_row(g, m, p, acc + (m - row_begin) * kGemmPanel);
  }
}
#else
void per_channel_gemm_avx2(const PerChannelGemm&, int64_t, int64_t, int64_t, int64_t) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
