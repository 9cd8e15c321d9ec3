// The multiply-add rates of one core on the three AVX2 arithmetics the vision attention could use
// (a measurement kept with its results; not part of the package):
//   float32 FMA (vfmadd, 8 products a lane group), the float32 attention's;
//   int16 pairs (vpmaddwd, 16 products, + vpaddd), the tried int16 attention's;
//   uint8 x int8 (vpmaddubsw, 32 products, + vpmaddwd by 1 + vpaddd), oneDNN's AVX2 INT8.
// Ten independent accumulators each (more than latency x ports), an empty asm between updates so
// the compiler cannot merge the products. Build: g++ -O2 arithmetic_peaks.cpp -o arithmetic_peaks
// Run one copy for one core, two at once for both cores (their clock drops).
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define TEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)

__attribute__((target("avx2,fma"), noinline)) float fma_rate(long n) {
#define F_INIT(i) __m256 a##i = _mm256_set1_ps(i * 0.001f);
  TEN(F_INIT)
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.0001f);
  for (long i = 0; i < n; ++i) {
#define F_STEP(i) a##i = _mm256_fmadd_ps(a##i, x, y);
    TEN(F_STEP)
  }
  __m256 s = _mm256_setzero_ps();
#define F_SUM(i) s = _mm256_add_ps(s, a##i);
  TEN(F_SUM)
  return _mm256_cvtss_f32(s);
}

#define I_INIT(i) __m256i a##i = _mm256_set1_epi32(i);
#define I_SUM(i) s = _mm256_add_epi32(s, a##i);

__attribute__((target("avx2,fma"), noinline)) int int16_rate(long n) {
  TEN(I_INIT)
  __m256i x = _mm256_set1_epi16(3);
  const __m256i y = _mm256_set1_epi16(5);
  for (long i = 0; i < n; ++i) {
#define W_STEP(i) a##i = _mm256_add_epi32(_mm256_madd_epi16(x, y), a##i); asm volatile("" : "+x"(x));
    TEN(W_STEP)
  }
  __m256i s = _mm256_setzero_si256();
  TEN(I_SUM)
  return _mm256_cvtsi256_si32(s);
}

__attribute__((target("avx2,fma"), noinline)) int int8_rate(long n) {
  TEN(I_INIT)
  __m256i x = _mm256_set1_epi8(3);
  const __m256i y = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1);
  for (long i = 0; i < n; ++i) {
#define B_STEP(i) \
  a##i = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(x, y), one), a##i); asm volatile("" : "+x"(x));
    TEN(B_STEP)
  }
  __m256i s = _mm256_setzero_si256();
  TEN(I_SUM)
  return _mm256_cvtsi256_si32(s);
}

template <class F>
double seconds(F f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int main() {
  const long n = 200000000;
  volatile float keep_f;
  volatile int keep_i;
  for (int rep = 0; rep < 2; ++rep) {
    const double f = seconds([&] { keep_f = fma_rate(n); });
    const double w = seconds([&] { keep_i = int16_rate(n); });
    const double b = seconds([&] { keep_i = int8_rate(n); });
    std::printf("float32 FMA %.1f  int16 vpmaddwd+vpaddd %.1f  int8 vpmaddubsw+vpmaddwd+vpaddd %.1f  (G multiply-adds/s)\n",
                n * 10 * 8 / f / 1e9, n * 10 * 16 / w / 1e9, n * 10 * 32 / b / 1e9);
  }
}
