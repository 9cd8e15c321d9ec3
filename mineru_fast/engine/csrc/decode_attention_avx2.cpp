// The language model's decode attention, AVX2 + FMA: see kernels.h's DecodeAttention for the
// arithmetic. The same operations as decode_attention_avx512.cpp on 8-lane halves of its 16-lane
// vectors, so the same bits: every float lane's chain of multiply-adds is the same, a key's 16
// partial sums are added in the same tree (lanes o + 8, then o + 4, o + 2, o + 1), and the
// probabilities' sum and the outputs are accumulated lane for lane as there.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#define ISA_TARGET "avx2,fma"
#include "isa_begin.h"
#define MINERU_FAST_EXP2_AVX2
#include "simd_math.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// The scores of 8 keys from their partial sums u[t] (u[t][o] = lane o + lane o + 8 of key t's 16
// products): lanes o and o + 4 (within each key), then o and o + 2, then o and o + 1, the tree of
// decode_attention_avx512.cpp's sum16; lane t of the result is key t.
inline __m256 sum8(const __m256 u[8]) {
  __m256 w[4], x[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: key i's 4 sums, lanes 4-7: key i + 4's
    w[i] = _mm256_add_ps(_mm256_permute2f128_ps(u[i], u[i + 4], 0x20), _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  for (int i = 0; i < 2; ++i)  // per 128-bit half: 2 sums of key 2i, then 2 of key 2i + 1 (and + 4)
    x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// x * cos + roll(x, d / 2) * signed_sin of one head of d = 8 DH values (three roundings, as
// model.apply_rotary's three operators).
template <int DH>
void rotate(const float* x, const float* cos, const float* sin, __m256 out[DH]) {
  constexpr int64_t d = DH * 8;
  alignas(32) float rolled[d];
  std::memcpy(rolled, x + d / 2, d / 2 * sizeof(float));
  std::memcpy(rolled + d / 2, x, d / 2 * sizeof(float));
  for (int c = 0; c < DH; ++c)
    out[c] = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * c), _mm256_loadu_ps(cos + 8 * c)),
                           _mm256_mul_ps(_mm256_load_ps(rolled + 8 * c), _mm256_loadu_ps(sin + 8 * c)));
}

// DH = d / 8, even (d a multiple of 16): half h of 16-lane chunk c is q[2 c + h].
template <int DH>
void query_head(const DecodeAttention& a, int64_t row, int64_t head, float* scores) {
  constexpr int64_t d = DH * 8;
  const int64_t width = (a.heads + 2 * a.kv_heads) * d, group = a.heads / a.kv_heads;
  const int64_t n = a.positions[row] + 1, slot_offset = (a.row_slots[row] * a.kv_heads + head / group) * a.max_len * d;
  const float* keys = a.k_cache + slot_offset;
  const float* values = a.v_cache + slot_offset;
  __m256 q[DH];
  rotate<DH>(a.qkv + row * width + head * d, a.cos + row * d, a.sin + row * d, q);
  const __m256 qscale = _mm256_set1_ps(a.scale * kLog2e);
  for (int c = 0; c < DH; ++c) q[c] = _mm256_mul_ps(q[c], qscale);

  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 block_max = _mm256_set1_ps(-INFINITY);
  for (int64_t key = 0; key < n; key += 8) {  // every 16-key block whole: the second pass reads 16 at a time
    __m256 u[8];
    for (int t = 0; t < 8; ++t) {
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      if (key + t < n) {
        const float* k = keys + (key + t) * d;
        lo = _mm256_mul_ps(q[0], _mm256_loadu_ps(k));
        hi = _mm256_mul_ps(q[1], _mm256_loadu_ps(k + 8));
        for (int c = 1; c < DH / 2; ++c) {
          lo = _mm256_fmadd_ps(q[2 * c], _mm256_loadu_ps(k + 16 * c), lo);
          hi = _mm256_fmadd_ps(q[2 * c + 1], _mm256_loadu_ps(k + 16 * c + 8), hi);
        }
      }
      u[t] = _mm256_add_ps(lo, hi);
    }
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - key)), lane));
    const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sum8(u), live);
    _mm256_storeu_ps(scores + key, s);
    block_max = _mm256_max_ps(block_max, s);
  }
  if ((n + 7) / 8 % 2 == 1) _mm256_storeu_ps(scores + (n + 7) / 8 * 8, _mm256_set1_ps(-INFINITY));
  alignas(32) float maxima[8];
  _mm256_store_ps(maxima, block_max);
  const __m256 m = _mm256_set1_ps(*std::max_element(maxima, maxima + 8));
  __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15 of a 16-key block
  for (int64_t key = 0; key < n; key += 16) {
    const __m256 p_lo = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + key), m));  // 0 past n
    const __m256 p_hi = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + key + 8), m));
    _mm256_storeu_ps(scores + key, p_lo);
    _mm256_storeu_ps(scores + key + 8, p_hi);
    sum_lo = _mm256_add_ps(sum_lo, p_lo);
    sum_hi = _mm256_add_ps(sum_hi, p_hi);
  }
  // out = sum over keys of p v: even and odd keys in two sets of accumulators (two add chains)
  __m256 even[DH], odd[DH];
  for (int c = 0; c < DH; ++c) even[c] = odd[c] = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    const __m256 p0 = _mm256_set1_ps(scores[t]), p1 = _mm256_set1_ps(scores[t + 1]);
    for (int c = 0; c < DH; ++c) {
      even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(values + t * d + 8 * c), even[c]);
      odd[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(values + (t + 1) * d + 8 * c), odd[c]);
    }
  }
  if (t < n) {
    const __m256 p0 = _mm256_set1_ps(scores[t]);
    for (int c = 0; c < DH; ++c) even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(values + t * d + 8 * c), even[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum_lanes(_mm256_add_ps(sum_lo, sum_hi)));
  float* y = a.out + (row * a.heads + head) * d;
  for (int c = 0; c < DH; ++c) _mm256_storeu_ps(y + 8 * c, _mm256_mul_ps(_mm256_add_ps(even[c], odd[c]), inv));
}

template <int DH>
void write_row(const DecodeAttention& a, int64_t row) {
  constexpr int64_t d = DH * 8;
  const int64_t width = (a.heads + 2 * a.kv_heads) * d, position = a.positions[row];
  const float* x = a.qkv + row * width;
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    const int64_t at = ((a.row_slots[row] * a.kv_heads + h) * a.max_len + position) * d;
    __m256 k[DH];
    rotate<DH>(x + (a.heads + h) * d, a.cos + row * d, a.sin + row * d, k);
    for (int c = 0; c < DH; ++c) {
      _mm256_storeu_ps(a.k_cache + at + 8 * c, k[c]);
      _mm256_storeu_ps(a.v_cache + at + 8 * c, _mm256_loadu_ps(x + (a.heads + a.kv_heads + h) * d + 8 * c));
    }
  }
}

}  // namespace

void decode_write_avx2(const DecodeAttention& a, int64_t row) {
  with_chunks(a.d, [&](auto chunks) { write_row<2 * decltype(chunks)::value>(a, row); });
}

void decode_heads_avx2(const DecodeAttention& a, int64_t item_begin, int64_t item_end, float* scores) {
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t row = item / a.heads, head = item % a.heads;
    with_chunks(a.d, [&](auto chunks) { query_head<2 * decltype(chunks)::value>(a, row, head, scores); });
  }
}
#else
void decode_write_avx2(const DecodeAttention&, int64_t) {}
void decode_heads_avx2(const DecodeAttention&, int64_t, int64_t, float*) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
