// The language model's decode attention, AVX-512F: see kernels.h's DecodeAttention for the arithmetic.
//
// One work item is one query head of one row (decode_attention_avx2.cpp does the same operations
// on 8-lane halves: the same bits). Its rotated query (times scale * log2(e), so the
// softmax is a power of 2) is held in registers; the scores of 16 keys at a time are 16 vectors of
// partial products summed across lanes by a transpose tree (sum16), then the probabilities
// 2^(s - max), then the values summed with them. The keys and values of a row's group of query heads
// stay in L2 between its heads (1,500 positions of 64 float32 dims: 384 KB each).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#define ISA_TARGET "avx512f,avx512dq,fma"
#include "isa_begin.h"
#include "simd_math.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Lane 4 k + p of the result is the sum of the 16 lanes of v[4 p + k] (so the caller puts key
// 4 k + p in v[4 p + k]): four levels of block shuffles and adds.
inline __m512 sum16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: 8 partial sums of v[2i]; lanes 8-15: of v[2i + 1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit block k: 4 partial sums of v[4i + k]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: 2 partial sums of v[8i + k], then 2 of v[8i + 4 + k]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// x * cos + roll(x, d / 2) * signed_sin of one head of d = 16 DV values (three roundings, as
// model.apply_rotary's three operators).
template <int DV>
void rotate(const float* x, const float* cos, const float* sin, __m512 out[DV]) {
  constexpr int64_t d = DV * 16;
  alignas(64) float rolled[d];
  std::memcpy(rolled, x + d / 2, d / 2 * sizeof(float));
  std::memcpy(rolled + d / 2, x, d / 2 * sizeof(float));
  for (int c = 0; c < DV; ++c)
    out[c] = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * c), _mm512_loadu_ps(cos + 16 * c)),
                           _mm512_mul_ps(_mm512_load_ps(rolled + 16 * c), _mm512_loadu_ps(sin + 16 * c)));
}

template <int DV>
void query_head(const DecodeAttention& a, int64_t row, int64_t head, float* scores) {
  constexpr int64_t d = DV * 16;
  const int64_t width = (a.heads + 2 * a.kv_heads) * d, group = a.heads / a.kv_heads;
  const int64_t n = a.positions[row] + 1, slot_offset = (a.row_slots[row] * a.kv_heads + head / group) * a.max_len * d;
  const float* keys = a.k_cache + slot_offset;
  const float* values = a.v_cache + slot_offset;
  __m512 q[DV];
  rotate<DV>(a.qkv + row * width + head * d, a.cos + row * d, a.sin + row * d, q);
  const __m512 qscale = _mm512_set1_ps(a.scale * kLog2e);
  for (int c = 0; c < DV; ++c) q[c] = _mm512_mul_ps(q[c], qscale);

  __m512 block_max = _mm512_set1_ps(-INFINITY);
  for (int64_t key = 0; key < n; key += 16) {
    __m512 partial[16];
    for (int t = 0; t < 16; ++t) {
      __m512 p = _mm512_setzero_ps();
      if (key + t < n) {
        const float* k = keys + (key + t) * d;
        p = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
        for (int c = 1; c < DV; ++c) p = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), p);
      }
      partial[4 * (t % 4) + t / 4] = p;
    }
    const int64_t valid = std::min<int64_t>(16, n - key);
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>((1u << valid) - 1u),
                                        sum16(partial));
    _mm512_storeu_ps(scores + key, s);
    block_max = _mm512_max_ps(block_max, s);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(block_max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t key = 0; key < n; key += 16) {
    const __m512 p = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + key), m));  // 0 past n
    _mm512_storeu_ps(scores + key, p);
    sum = _mm512_add_ps(sum, p);
  }
  // out = sum over keys of p v: even and odd keys in two sets of accumulators (two add chains)
  __m512 even[DV], odd[DV];
  for (int c = 0; c < DV; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    const __m512 p0 = _mm512_set1_ps(scores[t]), p1 = _mm512_set1_ps(scores[t + 1]);
    for (int c = 0; c < DV; ++c) {
      even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(values + t * d + 16 * c), even[c]);
      odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(values + (t + 1) * d + 16 * c), odd[c]);
    }
  }
  if (t < n) {
    const __m512 p0 = _mm512_set1_ps(scores[t]);
    for (int c = 0; c < DV; ++c) even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(values + t * d + 16 * c), even[c]);
  }
  const float total = sum_lanes(_mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1)));
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  float* y = a.out + (row * a.heads + head) * d;
  for (int c = 0; c < DV; ++c) _mm512_storeu_ps(y + 16 * c, _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), inv));
}

template <int DV>
void write_row(const DecodeAttention& a, int64_t row) {
  constexpr int64_t d = DV * 16;
  const int64_t width = (a.heads + 2 * a.kv_heads) * d, position = a.positions[row];
  const float* x = a.qkv + row * width;
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    const int64_t at = ((a.row_slots[row] * a.kv_heads + h) * a.max_len + position) * d;
    __m512 k[DV];
    rotate<DV>(x + (a.heads + h) * d, a.cos + row * d, a.sin + row * d, k);
    for (int c = 0; c < DV; ++c) {
      _mm512_storeu_ps(a.k_cache + at + 16 * c, k[c]);
      _mm512_storeu_ps(a.v_cache + at + 16 * c, _mm512_loadu_ps(x + (a.heads + a.kv_heads + h) * d + 16 * c));
    }
  }
}

}  // namespace

void decode_write_avx512(const DecodeAttention& a, int64_t row) {
  with_chunks(a.d, [&](auto chunks) { write_row<decltype(chunks)::value>(a, row); });
}

void decode_heads_avx512(const DecodeAttention& a, int64_t item_begin, int64_t item_end, float* scores) {
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t row = item / a.heads, head = item % a.heads;
    with_chunks(a.d, [&](auto chunks) { query_head<decltype(chunks)::value>(a, row, head, scores); });
  }
}
#else
void decode_write_avx512(const DecodeAttention&, int64_t) {}
void decode_heads_avx512(const DecodeAttention&, int64_t, int64_t, float*) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
