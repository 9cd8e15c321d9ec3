// The feed-forward's SiLU-gated product, AVX2 + FMA: ffn_avx512.cpp's operations on 8 lanes (the same
// bits; see kernels.h's silu_mul).

#include <cmath>
#include <cstdint>

#include "kernels.h"

#define ISA_TARGET "avx2,fma"
#include "isa_begin.h"
#define MINERU_FAST_EXP2_AVX2
#include "simd_math.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
void silu_mul_avx2(const float* gate, const float* up, int64_t n, float* y) {
  const __m256 minus_log2e = _mm256_set1_ps(-kSiluLog2e), one = _mm256_set1_ps(1.0f);
  const __m256 lowest = _mm256_set1_ps(kSiluLowestExponent);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  alignas(32) float g_tail[8], u_tail[8], y_tail[8];
  for (int64_t i = 0; i < n; i += 8) {
    const bool whole = n - i >= 8;
    const float* g_at = gate + i;
    const float* u_at = up + i;
    if (!whole) {  // the last lanes through a zero-padded copy
      for (int64_t j = 0; j < 8; ++j) {
        g_tail[j] = i + j < n ? gate[i + j] : 0.0f;
        u_tail[j] = i + j < n ? up[i + j] : 0.0f;
      }
      g_at = g_tail;
      u_at = u_tail;
    }
    const __m256 g = _mm256_loadu_ps(g_at);
    const __m256 x = _mm256_mul_ps(minus_log2e, _mm256_and_ps(g, magnitude));
    const __m256 t = _mm256_and_ps(_mm256_cmp_ps(x, lowest, _CMP_GE_OQ), exp2_nonpositive(x));  // e^-|g|
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, t), negative);
    const __m256 out = _mm256_mul_ps(_mm256_div_ps(numerator, _mm256_add_ps(one, t)), _mm256_loadu_ps(u_at));
    if (whole) {
      _mm256_storeu_ps(y + i, out);
    } else {
      _mm256_store_ps(y_tail, out);
      for (int64_t j = 0; i + j < n; ++j) y[i + j] = y_tail[j];
    }
  }
}
#else
void silu_mul_avx2(const float*, const float*, int64_t, float*) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
