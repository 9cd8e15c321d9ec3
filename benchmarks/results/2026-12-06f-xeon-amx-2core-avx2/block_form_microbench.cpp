// The block kernel's AVX2 inner loop (csrc/int8_block_avx2.cpp's block_tile<4, 1>: |q_w| and q_x with q_w's sign,
// vpmaddubsw + vpmaddwd, 4 rows x 16 outputs per 4 k) against a form without vpsignb (int16 values, two vpmaddwd
// per 4 k, the same int32 sums), 4 and 6 rows x 16 outputs per 2 k; one thread, operands in L1, GMAC/s.
// A throwaway measurement, not part of the package: g++ -O3 -mavx2 -mfma block_form_microbench.cpp && ./a.out
// (the 6-row form spills registers at -O3 with GCC; the 4-row form does not).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
using clk = std::chrono::steady_clock;
static int8_t W8[16*1024*4]; static int8_t X8[8*4096];
static int16_t W16[16*1024*2*2]; static int16_t X16[8*4096];
__attribute__((noinline)) void sign_form(int64_t groups, __m256i out[8]) {
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  __m256i acc[4][2]; for (auto& a : acc) a[0] = a[1] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wabs[2], wsgn[2];
    for (int h = 0; h < 2; ++h) { __m256i raw = _mm256_loadu_si256((const __m256i*)(W8 + (g & 1023) * 64 + 32*h)); wsgn[h] = _mm256_xor_si256(raw, flip); wabs[h] = _mm256_abs_epi8(wsgn[h]); }
    for (int j = 0; j < 4; ++j) { int32_t four; memcpy(&four, X8 + j*4096 + (g & 1023)*4, 4); __m256i xv = _mm256_set1_epi32(four);
      for (int h = 0; h < 2; ++h) acc[j][h] = _mm256_add_epi32(acc[j][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(xv, wsgn[h])), ones)); }
  }
  for (int j = 0; j < 4; ++j) { out[2*j] = acc[j][0]; out[2*j+1] = acc[j][1]; }
}
template <int MR>
__attribute__((noinline)) void s16_form(int64_t pairs, __m256i out[12]) {
  __m256i acc[MR][2]; for (auto& a : acc) a[0] = a[1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    const int16_t* w = W16 + (p & 2047) * 32;
    __m256i w0 = _mm256_loadu_si256((const __m256i*)w), w1 = _mm256_loadu_si256((const __m256i*)(w + 16));
    for (int j = 0; j < MR; ++j) { int32_t two; memcpy(&two, X16 + j*4096/2*2 + (p & 2047)*2, 4); __m256i xv = _mm256_set1_epi32(two);
      acc[j][0] = _mm256_add_epi32(acc[j][0], _mm256_madd_epi16(w0, xv));
      acc[j][1] = _mm256_add_epi32(acc[j][1], _mm256_madd_epi16(w1, xv)); }
  }
  for (int j = 0; j < MR && j < 6; ++j) { out[2*j] = acc[j][0]; out[2*j+1] = acc[j][1]; }
}
int main() {
  __m256i o[12]; const int64_t kk = 1 << 24; // k values
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = clk::now(); sign_form(kk / 4, o); auto t1 = clk::now();
    double s = std::chrono::duration<double>(t1 - t0).count(); double macs = 4.0 * 16 * kk;
    printf("sign 4x16: %.1f GMAC/s\n", macs / s / 1e9);
    t0 = clk::now(); s16_form<6>(kk / 2, o); t1 = clk::now(); s = std::chrono::duration<double>(t1 - t0).count(); macs = 6.0 * 16 * kk;
    printf("s16 6x16: %.1f GMAC/s\n", macs / s / 1e9);
    t0 = clk::now(); s16_form<4>(kk / 2, o); t1 = clk::now(); s = std::chrono::duration<double>(t1 - t0).count(); macs = 4.0 * 16 * kk;
    printf("s16 4x16: %.1f GMAC/s\n", macs / s / 1e9);
  }
  volatile int sink = _mm256_extract_epi32(o[0], 0); (void)sink;
}
