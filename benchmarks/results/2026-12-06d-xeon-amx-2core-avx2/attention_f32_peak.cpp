// The own float32 attention (csrc/attention_avx2.cpp) against the FMA peak of the same cores,
// measured right after it (a measurement kept with its results; not part of the package): random
// q, k, v of n patches, 2 heads of 80 (the vision encoder's call), the pack and the query blocks
// on OpenMP threads as module.cpp splits them, the fastest of `reps` calls in GFLOP/s (4 n^2 d per
// head), then ten independent FMA chains per thread on every thread at once.
// Build, from the repository root:
//   g++ -O3 -std=c++17 -ffp-contract=off -fopenmp -Imineru_fast/engine/csrc \
//       benchmarks/results/2026-12-06d-xeon-amx-2core-avx2/attention_f32_peak.cpp \
//       mineru_fast/engine/csrc/attention_avx2.cpp -o attention_f32_peak
// Run: OMP_NUM_THREADS=2 ./attention_f32_peak [n=5476] [heads=2] [reps=5]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels.h"

namespace mf = mineru_fast;

namespace {

float* align32(float* p) { return p + ((32 - reinterpret_cast<uintptr_t>(p) % 32) % 32) / sizeof(float); }

// Ten FMA chains in ten registers (named, so none lives in memory), an empty asm between steps so
// the compiler cannot merge them: more chains than FMA latency x ports.
#define TEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
__attribute__((target("avx2,fma"), noinline)) float fma_chains(long steps) {
#define INIT(i) __m256 a##i = _mm256_set1_ps(i * 0.001f);
  TEN(INIT)
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.0001f);
  for (long s = 0; s < steps; ++s) {
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, x, y);
    TEN(STEP)
#define KEEP(i) asm volatile("" : "+x"(a##i));
    TEN(KEEP)
  }
  float sum = 0;
#define SUM(i) sum += _mm256_cvtss_f32(a##i);
  TEN(SUM)
  return sum;
}

double peak_gflops() {  // every thread at once: 10 chains x 8 lanes x 2 flops per step
  const long steps = 20000000;
  const auto t0 = std::chrono::steady_clock::now();
  float sink = 0;
#pragma omp parallel reduction(+ : sink)
  sink += fma_chains(steps);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink == 12345.0f) std::printf(" ");
  return 160.0 * steps * omp_get_max_threads() / t / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atol(argv[1]) : 5476, heads = argc > 2 ? std::atol(argv[2]) : 2, d = 80;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::vector<float> q(heads * n * d), k(heads * n * d), v(heads * n * d), out(n * heads * d);
  std::srand(1);
  for (auto* x : {&q, &k, &v})
    for (auto& f : *x) f = (std::rand() / static_cast<float>(RAND_MAX) - 0.5f) * 3.4f;
  const mf::ImageAttention a{q.data(), k.data(), v.data(), {n * d, n * d, n * d}, {d, d, d}, out.data(),
                             heads * d,  heads,    n,        d,        1.0f / std::sqrt(80.0f)};
  const int64_t block_rows = mf::kF32AttentionQueryTiles * mf::kF32AttentionTileRows;
  const int64_t n_pad = (n + block_rows - 1) / block_rows * block_rows, packs = n_pad / 16, blocks = n_pad / block_rows;
  std::vector<float> qb(heads * n_pad * d + 8), kb(heads * n_pad * d + 8), vb(heads * n_pad * d + 8);
  const mf::F32AttentionBuffers b{align32(qb.data()), align32(kb.data()), align32(vb.data()), n_pad};
  double best = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < heads * packs; ++item)
      mf::attention_pack_avx2(a, item / packs, item % packs, item % packs + 1, b);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < heads * blocks; ++item)
      mf::attention_rows_avx2(a, item / blocks, item % blocks, item % blocks + 1, b);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double gflops = 4.0 * n * n * d * heads / best / 1e9, peak = peak_gflops();
  std::printf("n=%ld heads=%ld: %.1f ms, %.0f GFLOP/s; FMA peak %.0f GFLOP/s: %.0f %%\n", static_cast<long>(n),
              static_cast<long>(heads), best * 1e3, gflops, peak, 100 * gflops / peak);
}
