// 2^x in AVX-512F, shared by the attention kernels. Included after isa_begin.h (so compiled for the
// including file's target) and outside any namespace.

#pragma once

#if defined(MINERU_FAST_X86)
namespace mineru_fast {

// 2^x for x <= 0 (relative error below 3e-7; x below -150 gives +0, a NaN stays a NaN): x = i + f
// with i an integer and |f| <= 1/2, 2^f by a degree-5 polynomial (fitted on Chebyshev nodes), scaled
// by 2^i (vscalefps).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);  // vmaxps gives its second operand when one is NaN
  const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, i);
  __m512 p = _mm512_set1_ps(0.0013400432653725147f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009676037356257439f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550327152013779f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402210682630539f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471824645996f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, i);
}

}  // namespace mineru_fast
#endif
