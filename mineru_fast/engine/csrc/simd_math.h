// Vector math shared by the attention kernels, the same operations on every width (the same bits):
// 2^x for x <= 0 in AVX-512F and in AVX2 + FMA, and a sum of 8 lanes in a fixed order; and the
// dispatch of a head width to its compiled form. Included after
// isa_begin.h, outside any namespace, by a file that defines MINERU_FAST_EXP2_AVX2 before it when its
// target is AVX2 (the AVX-512 form of 2^x is the default).

#pragma once

#include <cstdint>
#include <type_traits>

#if defined(MINERU_FAST_X86)
namespace mineru_fast {

// f(std::integral_constant<int, C>{}) with C = d / 16, the 16-value chunks of a head of d values
// (16 to 128, a multiple of 16: the callers check it), so per-head code is compiled for each width.
template <class F>
inline void with_chunks(int64_t d, F&& f) {
  switch (d / 16) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{});
  }
}

// x = i + f with i the nearest integer and |f| <= 1/2; 2^f by a degree-5 polynomial (fitted on
// Chebyshev nodes; relative error below 3e-7), scaled by 2^i. x below -150 gives +0, a NaN stays a NaN.
constexpr float kExp2Poly[6] = {0.0013400432653725147f, 0.009676037356257439f, 0.05550327152013779f,
                                0.2402210682630539f,    0.6931471824645996f,   1.0000001192092896f};

// The sum of v's 8 lanes: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), whatever the compiler.
inline float sum_lanes(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // lanes 0, 1: a0 + a2, a1 + a3
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

#if defined(MINERU_FAST_EXP2_AVX2)
// 2^i as p * 2^(i + 64) (exact: a normal float times a power of 2 in range) * 2^-64: one rounding, as
// vscalefps rounds p * 2^i (denormal results included).
inline __m256 exp2_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-150.0f), x);  // vmaxps gives its second operand when one is NaN
  const __m256 i = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, i);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[c]));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127 + 64));
  const __m256 up = _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));  // 2^(i + 64), i in [-150, 0]
  return _mm256_mul_ps(_mm256_mul_ps(p, up), _mm256_set1_ps(0x1p-64f));
}
#else
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);  // vmaxps gives its second operand when one is NaN
  const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, i);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[c]));
  return _mm512_scalef_ps(p, i);
}
#endif

}  // namespace mineru_fast
#endif
