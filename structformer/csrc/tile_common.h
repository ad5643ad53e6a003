// Pieces shared by the tile kernel's forward (block_tile_attention.cpp) and backward
// (block_tile_attention_backward.cpp): MKL's GEMM, row views of one (batch, head), the task geometry,
// the input checks and the kept-tile softmax both passes compute.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <type_traits>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace structformer_tiles {

// Column-major BLAS GEMM, C = alpha · op(A) · op(B) + beta · C, for float and double.
template <typename T>
inline void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const int M = m, N = n, K = k, LDA = lda, LDB = ldb, LDC = ldc;
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&transa, &transb, &M, &N, &K, &alpha, a, &LDA, b, &LDB, &beta, c, &LDC);
  } else {
    dgemm_(&transa, &transb, &M, &N, &K, &alpha, a, &LDA, b, &LDB, &beta, c, &LDC);
  }
}

// Row-major view of one (batch, head) slice: element (token i, channel c) at base + i·row_stride + c.
template <typename T>
struct Rows {
  T* base;
  int64_t row_stride;
  T* row(int64_t i) const { return base + i * row_stride; }
};

template <typename T>
inline Rows<T> head_rows(const at::Tensor& x, int64_t b, int64_t h) {
  return Rows<T>{x.data_ptr<T>() + b * x.stride(0) + h * x.stride(1), x.stride(2)};
}

// The queries of one task: a query tile's rows past the dense ones (`rows` may be <= 0: nothing to do).
struct QueryTile {
  int64_t first, rows;
};

inline QueryTile query_tile(int64_t tile, int64_t bs, int64_t n_q, int64_t dense_rows) {
  const int64_t first = std::max(tile * bs, dense_rows);
  return {first, std::min((tile + 1) * bs, n_q) - first};
}

// P [rows, width] row-major = softmax over the kept keys of scale · Q Kᵀ for queries first..first+rows: the key
// tiles `keys[0..kept)` of `bs` keys each (slot j·bs + c is key keys[j]·bs + c; slots past n_k are −∞ before the
// softmax, 0 after). The dense rows are the case kept = 1, keys = {0}, bs = n_k.
template <typename T>
void tile_probabilities(const Rows<T>& qs, const Rows<T>& ks, const int64_t* keys, int64_t kept, int64_t bs,
                        int64_t n_k, int64_t d, double scale, int64_t first, int64_t rows, T* probabilities,
                        int64_t width, const at::Tensor& like) {
  const T minus_inf = -std::numeric_limits<T>::infinity();
  // S row-major [rows, len] = column-major [len, rows]: Sᵀ = K_J · Q_Iᵀ, K_J stored as column-major d × len
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t start = keys[j] * bs, len = std::min(bs, n_k - start);
    gemm<T>('T', 'N', len, rows, d, T(scale), ks.row(start), ks.row_stride, qs.row(first), qs.row_stride, T(0),
            probabilities + j * bs, width);
    for (int64_t r = 0; r < rows && len < bs; ++r)
      std::fill(probabilities + r * width + j * bs + len, probabilities + r * width + (j + 1) * bs, minus_inf);
  }
  at::Tensor view = at::from_blob(probabilities, {rows, width}, like.options());
  at::_softmax_out(view, view, -1, false);
}

// The checks both ops make on (q, k, v, block_indices, block_size, dense_rows), named by `op`.
void check_tile_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& block_indices, int64_t block_size, int64_t dense_rows);

}  // namespace structformer_tiles
