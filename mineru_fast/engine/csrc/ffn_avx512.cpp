// The feed-forward's SiLU-gated product, AVX-512F: see kernels.h's silu_mul for the arithmetic
// (ffn_avx2.cpp: the same operations on 8 lanes, the same bits).

#include <cmath>
#include <cstdint>

#include "kernels.h"

#define ISA_TARGET "avx512f,avx512bw,avx512dq,avx512vl,fma"
#include "isa_begin.h"
#include "simd_math.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
void silu_mul_avx512(const float* gate, const float* up, int64_t n, float* y) {
  const __m512 minus_log2e = _mm512_set1_ps(-kSiluLog2e), one = _mm512_set1_ps(1.0f);
  const __m512 lowest = _mm512_set1_ps(kSiluLowestExponent);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 g = _mm512_maskz_loadu_ps(valid, gate + i);
    const __m512 x = _mm512_mul_ps(minus_log2e, _mm512_abs_ps(g));
    const __m512 t = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ), exp2_nonpositive(x));  // e^-|g|
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 s = _mm512_div_ps(_mm512_mask_mul_ps(g, negative, g, t), _mm512_add_ps(one, t));
    _mm512_mask_storeu_ps(y + i, valid, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(valid, up + i)));
  }
}
#else
void silu_mul_avx512(const float*, const float*, int64_t, float*) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
