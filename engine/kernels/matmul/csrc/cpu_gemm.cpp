// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x, in float32 on the CPU.
//
// Why: a decode step on the CPU reads every weight once per step, so it is bound by memory bandwidth, but the
// BLAS sgemm that torch calls runs small-M products (2-8 rows: speculative verification, small batches) well
// below that bound on AVX2 machines. Here each weight row is read once for up to ROWS rows of x.
//
// Invariant: y[m, n] depends only on x[m] and w[n], never on how many rows share the call or where the row sits
// in it (same accumulation order for every m), so a request's tokens do not depend on its batch.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace {

constexpr int ROWS = 8;   // rows of x per pass over the weights: their accumulators fill half the vector registers

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int M>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, int64_t ldx, const float* w, const float* bias,
                                                    float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t K) {
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m]);
      for (int64_t k = K8; k < K; ++k) s = __builtin_fmaf(wn[k], x[m * ldx + k], s);
      y[m * ldy + n] = bias ? s + bias[n] : s;
    }
  }
}

using RowsFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t,
                        int64_t);
constexpr RowsFn KERNELS[ROWS + 1] = {nullptr,       rows_avx2<1>, rows_avx2<2>, rows_avx2<3>, rows_avx2<4>,
                                      rows_avx2<5>, rows_avx2<6>, rows_avx2<7>, rows_avx2<8>};
#endif

bool available() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// x: [M, K] rows ldx apart; w: [N, K] contiguous; y: [M, N] rows ldy apart; bias: [N] or 0. Threads split N.
void linear(uintptr_t x, int64_t ldx, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t ldy, int64_t M, int64_t N,
            int64_t K, int threads) {
#if defined(__x86_64__)
  if (!available()) throw std::runtime_error("cpu_gemm needs AVX2 and FMA");
  const auto* xp = reinterpret_cast<const float*>(x);
  const auto* wp = reinterpret_cast<const float*>(w);
  const auto* bp = reinterpret_cast<const float*>(bias);
  auto* yp = reinterpret_cast<float*>(y);
  auto run = [=](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      const int64_t rows = std::min<int64_t>(ROWS, M - m0);
      KERNELS[rows](xp + m0 * ldx, ldx, wp, bp, yp + m0 * ldy, ldy, n0, n1, K);
    }
  };
  py::gil_scoped_release release;
  // a thread gets >= 64K weights (256 KB): below that, starting it costs more than its share of the reads
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, N * K / (1 << 16)));
  if (parts == 1) {
    run(0, N);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (N + parts - 1) / parts;
  for (int64_t p = 1; p < parts; ++p)
    pool.emplace_back(run, std::min(N, p * chunk), std::min(N, (p + 1) * chunk));
  run(0, std::min(N, chunk));
  for (auto& t : pool) t.join();
#else
  throw std::runtime_error("cpu_gemm is built for x86-64 only");
#endif
}

}  // namespace

PYBIND11_MODULE(_cpu_gemm, m) {
  m.doc() = "float32 products of a few rows with a weight matrix on the CPU (AVX2 + FMA)";
  m.def("available", &available, "whether this CPU runs the kernel (AVX2 and FMA)");
  m.def("linear", &linear, py::arg("x"), py::arg("ldx"), py::arg("w"), py::arg("bias"), py::arg("y"),
        py::arg("ldy"), py::arg("rows"), py::arg("n"), py::arg("k"), py::arg("threads"));
}
