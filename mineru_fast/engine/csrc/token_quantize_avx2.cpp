// Per-token INT8 quantization of rows (AVX2 + FMA, run on the avx2 and avx512_vnni paths): the
// activations of the per-channel INT8 linears (quantize.py's onednn and gemv backends), one pass
// over a row from memory and one over it in cache, where PyTorch's operators take four passes
// over the whole input. See kernels.h's token quantization for the arithmetic.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

#define ISA_TARGET "avx2,fma"
#include "isa_begin.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

// The largest and the smallest of v's 8 lanes (exact in any order).
inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float min_lanes(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// trunc(x * inv + 128.5) of 8 values as int32 (one fused multiply-add: one rounding)
inline __m256i shifted(const float* x, __m256 inv) {
  return _mm256_cvttps_epi32(_mm256_fmadd_ps(_mm256_loadu_ps(x), inv, _mm256_set1_ps(128.5f)));
}

}  // namespace

void quantize_tokens_avx2(const float* x, int64_t cols, uint8_t* q, float* scale) {
  // the largest magnitude: max(max x, -min x), a NaN seen apart (max/min drop it)
  __m256 hi = _mm256_set1_ps(-INFINITY), lo = _mm256_set1_ps(INFINITY), nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    hi = _mm256_max_ps(hi, v);
    lo = _mm256_min_ps(lo, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float top = max_lanes(hi), bottom = min_lanes(lo);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = j; t < cols; ++t) {
    top = std::max(top, x[t]);
    bottom = std::min(bottom, x[t]);
    has_nan = has_nan || std::isnan(x[t]);
  }
  const float absmax = has_nan ? NAN : std::max(std::max(top, -bottom), kTokenScaleFloor);
  *scale = absmax / 127.0f;
  const float inv_f = (1.0f / absmax) * 127.0f;
  const __m256 inv = _mm256_set1_ps(inv_f);
  // packus per 128-bit lane leaves 4-value groups in the order a0 b0 c0 d0 a1 b1 c1 d1: put back
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  j = 0;
  for (; j + 32 <= cols; j += 32) {
    const __m256i ab = _mm256_packus_epi32(shifted(x + j, inv), shifted(x + j + 8, inv));
    const __m256i cd = _mm256_packus_epi32(shifted(x + j + 16, inv), shifted(x + j + 24, inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j),
                        _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order));
  }
  for (; j < cols; ++j) {
    const float value = std::fma(x[j], inv_f, 128.5f);
    q[j] = std::isnan(value) ? 0 : static_cast<uint8_t>(static_cast<int32_t>(value));
  }
}
#else
void quantize_tokens_avx2(const float*, int64_t, uint8_t*, float*) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
