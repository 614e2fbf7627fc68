/* Baseline for bench_core.py: random-row gather and scatter-add on a dense
 * float32 table, in plain C. Prints one JSON object:
 *   {"gather_rows_per_s": ..., "scatter_add_rows_per_s": ...}
 * Usage: gather ROWS DIM BATCH REPS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: gather ROWS DIM BATCH REPS\n");
    return 2;
  }
  const size_t rows = strtoull(argv[1], 0, 10), dim = strtoull(argv[2], 0, 10);
  const size_t batch = strtoull(argv[3], 0, 10);
  const int reps = atoi(argv[4]);
  float* table = malloc(rows * dim * sizeof(float));
  float* out = malloc(batch * dim * sizeof(float));
  uint64_t* idx = malloc(batch * sizeof(uint64_t));
  double* g = malloc(reps * sizeof(double));
  double* s = malloc(reps * sizeof(double));
  for (size_t i = 0; i < rows * dim; ++i) table[i] = (float)i;
  uint64_t x = 88172645463325252ull;
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < batch; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      idx[i] = x % rows;
    }
    double t0 = now();
    for (size_t i = 0; i < batch; ++i) memcpy(out + i * dim, table + idx[i] * dim, dim * 4);
    double t1 = now();
    for (size_t i = 0; i < batch; ++i) {
      float* row = table + idx[i] * dim;
      const float* grad = out + i * dim;
      for (size_t j = 0; j < dim; ++j) row[j] -= 0.01f * grad[j];
    }
    double t2 = now();
    g[r] = t1 - t0;
    s[r] = t2 - t1;
  }
  qsort(g, reps, sizeof(double), cmp);
  qsort(s, reps, sizeof(double), cmp);
  printf("{\"gather_rows_per_s\": %.1f, \"scatter_add_rows_per_s\": %.1f}\n", batch / g[reps / 2],
         batch / s[reps / 2]);
  return 0;
}
