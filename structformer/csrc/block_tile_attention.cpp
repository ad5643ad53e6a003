// Sparsifiner's attention on a block connectivity (Eq. 4–6 on whole kept key tiles), CPU forward only.
//
// For every (batch, head, query tile I) with kept key tiles J ∈ block_indices[b, h, I]:
//     S_J = scale · Q_I K_Jᵀ          one BLAS GEMM per kept tile, read where the tile lies in K (no copy)
//     P   = softmax([S_J1 … S_Jk])    ATen's vectorised softmax over the row of kept keys
//     O_I = Σ_J P_J V_J               one accumulating GEMM per kept tile
// Query tiles run in parallel (at::parallel_for), each on a bs × kept·bs score buffer that stays in cache.
// A partial last key tile enters with its real keys only, a partial last query tile with its real rows.
// The first `dense_rows` queries (the cls token's row) attend to every key instead: one more task per
// (batch, head), and the tiles leave those rows to it.
// The slow, obvious reference is structformer.functional.sparsifiner.masked_attention on
// block_indices_to_mask (tests/test_sparsifiner_kernel.py compares them).
//
// block_connectivity is the predictor of the same block mask (Eq. 1–3 on tile means, then the top tiles), for
// every (batch, head) in parallel: A_down = softmax(Q K_downᵀ) [n × p] (K_down = W_down K, scaled), Ã_down =
// A_down ⊙ 1[A_down > τ], its means over query tiles [qt × p] times the key-tile means of W̃_up [p × kt],
// then the `kept` highest key tiles of each query tile, ties to the lower tile (as top_tiles' stable sort).
// Its reference is pooled_block_scores + top_tiles.
//
// Why by hand: torch's fused CPU attention takes no tile list, and FlexAttention compiled for the CPU ran at
// 0.95x dense SDPA on these masks (docs/sparsifiner.md); gathering the tiles first copies 5 MB per layer at
// n = 577. The GEMMs are MKL's, exported by libtorch_cpu (Fortran sgemm_/dgemm_); the softmax is ATen's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace {

// Column-major BLAS GEMM, C = alpha · op(A) · op(B) + beta · C, for float and double.
template <typename T>
void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  const int M = m, N = n, K = k, LDA = lda, LDB = ldb, LDC = ldc;
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&transa, &transb, &M, &N, &K, &alpha, a, &LDA, b, &LDB, &beta, c, &LDC);
  } else {
    dgemm_(&transa, &transb, &M, &N, &K, &alpha, a, &LDA, b, &LDB, &beta, c, &LDC);
  }
}

// Row-major views of one (batch, head) slice: element (token i, channel c) at base + i·row_stride + c.
template <typename T>
struct Rows {
  T* base;
  int64_t row_stride;
  T* row(int64_t i) const { return base + i * row_stride; }
};

// softmax(scale · Q Kᵀ) V for `rows` queries from `first` on all n_k keys (the dense rows), scores in `buffer`.
template <typename T>
void attend_all(const Rows<T>& qs, const Rows<T>& ks, const Rows<T>& vs, const Rows<T>& os, int64_t first,
                int64_t rows, int64_t n_k, int64_t d, double scale, std::vector<T>& buffer, const at::Tensor& like) {
  buffer.resize(std::max<size_t>(buffer.size(), rows * n_k));
  T* scores = buffer.data();
  gemm<T>('T', 'N', n_k, rows, d, T(scale), ks.row(0), ks.row_stride, qs.row(first), qs.row_stride, T(0), scores, n_k);
  at::Tensor view = at::from_blob(scores, {rows, n_k}, like.options());
  at::_softmax_out(view, view, -1, false);
  gemm<T>('N', 'N', d, rows, n_k, T(1), vs.row(0), vs.row_stride, scores, n_k, T(0), os.row(first), os.row_stride);
}

template <typename T>
void attend_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& block_indices,
                  int64_t bs, double scale, int64_t dense_rows, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), n_q = q.size(2), d = q.size(3), n_k = k.size(2);
  const int64_t tiles = block_indices.size(2), kept = block_indices.size(3), width = kept * bs;
  const int64_t* chosen = block_indices.data_ptr<int64_t>();
  auto slice = [](const at::Tensor& x, int64_t b, int64_t h) {
    return Rows<T>{x.data_ptr<T>() + b * x.stride(0) + h * x.stride(1), x.stride(2)};
  };
  const T minus_inf = -std::numeric_limits<T>::infinity();
  const int64_t per_head = tiles + (dense_rows > 0);      // the query tiles, then the dense rows' task
  at::parallel_for(0, batch * heads * per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buffer(bs * width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (heads * per_head), h = task / per_head % heads, tile = task % per_head;
      const Rows<T> qs = slice(q, b, h), ks = slice(k, b, h), vs = slice(v, b, h), os = slice(out, b, h);
      if (tile == tiles) {
        attend_all<T>(qs, ks, vs, os, 0, std::min(dense_rows, n_q), n_k, d, scale, buffer, q);
        continue;
      }
      const int64_t first = std::max(tile * bs, dense_rows), rows = std::min((tile + 1) * bs, n_q) - first;
      if (rows <= 0) continue;                             // a tile of dense rows only
      const int64_t* keys = chosen + ((b * heads + h) * tiles + tile) * kept;
      T* scores = buffer.data();
      // S row-major [rows, width] = column-major [width, rows]: S_Jᵀ = K_J · Q_Iᵀ, so op(A) = K_J (A stored as
      // column-major d × len, transposed) and op(B) = Q_Iᵀ (column-major d × rows as stored)
      for (int64_t j = 0; j < kept; ++j) {
        const int64_t start = keys[j] * bs, len = std::min(bs, n_k - start);
        gemm<T>('T', 'N', len, rows, d, T(scale), ks.row(start), ks.row_stride, qs.row(first), qs.row_stride, T(0),
                scores + j * bs, width);
        for (int64_t r = 0; r < rows && len < bs; ++r)       // slots past n_k: out of the softmax
          std::fill(scores + r * width + j * bs + len, scores + r * width + (j + 1) * bs, minus_inf);
      }
      at::Tensor view = at::from_blob(scores, {rows, width}, q.options());
      at::_softmax_out(view, view, -1, false);
      // O row-major [rows, d] = column-major [d, rows]: O_Iᵀ = Σ_J V_Jᵀ P_Jᵀ, V_J stored as column-major d × len
      for (int64_t j = 0; j < kept; ++j) {
        const int64_t start = keys[j] * bs, len = std::min(bs, n_k - start);
        gemm<T>('N', 'N', d, rows, len, T(1), vs.row(start), vs.row_stride, scores + j * bs, width, T(j ? 1 : 0),
                os.row(first), os.row_stride);
      }
    }
  });
}

at::Tensor block_tile_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& block_indices, int64_t block_size, double scale,
                                int64_t dense_rows) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && block_indices.device().is_cpu(),
              "block_tile_attention: q, k, v and block_indices must be CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "block_tile_attention: q, k, v must be [B, H, n, d]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "block_tile_attention: q, k, v must all be float32 or all float64, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "block_tile_attention: q [B, H, n, d], k and v [B, H, m, d] expected, got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  // BLAS reads each row at a stride of at least its width (lda >= d): channels contiguous, rows apart
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && q.stride(2) >= q.size(3) &&
                  k.stride(2) >= k.size(3) && v.stride(2) >= v.size(3),
              "block_tile_attention: q, k, v need contiguous channels and a token stride >= d");
  TORCH_CHECK(block_size >= 1, "block_tile_attention: block_size must be >= 1, got ", block_size);
  TORCH_CHECK(dense_rows >= 0 && dense_rows <= q.size(2), "block_tile_attention: dense_rows must be in 0..",
              q.size(2), ", got ", dense_rows);
  const int64_t query_tiles = (q.size(2) + block_size - 1) / block_size;
  const int64_t key_tiles = (k.size(2) + block_size - 1) / block_size;
  TORCH_CHECK(block_indices.scalar_type() == at::kLong && block_indices.is_contiguous() && block_indices.dim() == 4 &&
                  block_indices.size(0) == q.size(0) && block_indices.size(1) == q.size(1) &&
                  block_indices.size(2) == query_tiles && block_indices.size(3) >= 1 &&
                  block_indices.size(3) <= key_tiles,
              "block_tile_attention: block_indices must be contiguous int64 [B, H, ", query_tiles,
              " query tiles, 1..", key_tiles, " kept tiles], got ", block_indices.sizes());
  const int64_t kept = block_indices.size(3);
  const int64_t* chosen = block_indices.data_ptr<int64_t>();
  for (int64_t row = 0; row < block_indices.numel() / kept; ++row) {
    const int64_t* keys = chosen + row * kept;
    for (int64_t j = 0; j < kept; ++j) {
      TORCH_CHECK(keys[j] >= 0 && keys[j] < key_tiles, "block_tile_attention: block index ", keys[j],
                  " out of range; accepted 0..", key_tiles - 1);
      for (int64_t i = 0; i < j; ++i)
        TORCH_CHECK(keys[i] != keys[j], "block_tile_attention: key tile ", keys[j], " kept twice in one row");
    }
  }
  // [B, n, H, d] memory seen as [B, H, n, d]: merging the heads afterwards is a view, not a copy
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).permute({0, 2, 1, 3});
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_tile_attention", [&] {
    attend_tiles<scalar_t>(q, k, v, block_indices, block_size, scale, dense_rows, out);
  });
  return out;
}

template <typename T>
void predict_tiles(const at::Tensor& q, const at::Tensor& k_down, const at::Tensor& basis_tiles, double tau,
                   int64_t bs, int64_t kept, at::Tensor& chosen) {
  const int64_t batch = q.size(0), heads = q.size(1), n = q.size(2), dp = q.size(3), p = k_down.size(2);
  const int64_t query_tiles = (n + bs - 1) / bs, key_tiles = basis_tiles.size(1);
  const T* basis = basis_tiles.data_ptr<T>();
  int64_t* out = chosen.data_ptr<int64_t>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> coefficients(n * p), pooled(query_tiles * p), scores(key_tiles);
    std::vector<int64_t> order(key_tiles);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      const T* qs = q.data_ptr<T>() + b * q.stride(0) + h * q.stride(1);
      const T* ks = k_down.data_ptr<T>() + b * k_down.stride(0) + h * k_down.stride(1);
      // A_down row-major [n, p] = column-major [p, n] = K_down (column-major dp × p, transposed) · Qᵀ
      gemm<T>('T', 'N', p, n, dp, T(1), ks, k_down.stride(2), qs, q.stride(2), T(0), coefficients.data(), p);
      at::Tensor view = at::from_blob(coefficients.data(), {n, p}, q.options());
      at::_softmax_out(view, view, -1, false);
      std::fill(pooled.begin(), pooled.end(), T(0));
      for (int64_t i = 0; i < n; ++i) {                    // Eq. 2 threshold, summed per query tile
        T* row = pooled.data() + (i / bs) * p;
        const T* a = coefficients.data() + i * p;
        for (int64_t c = 0; c < p; ++c) row[c] += a[c] > T(tau) ? a[c] : T(0);
      }
      for (int64_t tile = 0; tile < query_tiles; ++tile) {
        const T members = T(std::min(bs, n - tile * bs));
        const T* row = pooled.data() + tile * p;
        for (int64_t j = 0; j < key_tiles; ++j) {           // (tile mean of Ã_down) · (key-tile mean of W̃_up)
          T sum = 0;
          for (int64_t c = 0; c < p; ++c) sum += row[c] * basis[c * key_tiles + j];
          scores[j] = sum / members;
        }
        for (int64_t j = 0; j < key_tiles; ++j) order[j] = j;
        std::partial_sort(order.begin(), order.begin() + kept, order.end(), [&](int64_t x, int64_t y) {
          return scores[x] > scores[y] || (scores[x] == scores[y] && x < y);
        });
        std::copy(order.begin(), order.begin() + kept, out + (task * query_tiles + tile) * kept);
      }
    }
  });
}

at::Tensor block_connectivity(const at::Tensor& q, const at::Tensor& k_down, const at::Tensor& basis_tiles,
                              double tau, int64_t block_size, int64_t kept) {
  TORCH_CHECK(q.device().is_cpu() && k_down.device().is_cpu() && basis_tiles.device().is_cpu(),
              "block_connectivity: q, k_down and basis_tiles must be CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k_down.dim() == 4 && basis_tiles.dim() == 2,
              "block_connectivity: q [B, H, n, d], k_down [B, H, p, d] and basis_tiles [p, key tiles] expected");
  TORCH_CHECK(q.scalar_type() == k_down.scalar_type() && q.scalar_type() == basis_tiles.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "block_connectivity: q, k_down, basis_tiles must all be float32 or all float64");
  TORCH_CHECK(k_down.size(0) == q.size(0) && k_down.size(1) == q.size(1) && k_down.size(3) == q.size(3) &&
                  basis_tiles.size(0) == k_down.size(2) && basis_tiles.is_contiguous(),
              "block_connectivity: shapes q ", q.sizes(), ", k_down ", k_down.sizes(), ", basis_tiles ",
              basis_tiles.sizes(), " do not fit (contiguous basis_tiles [p, key tiles])");
  TORCH_CHECK(q.stride(3) == 1 && k_down.stride(3) == 1 && q.stride(2) >= q.size(3) && k_down.stride(2) >= k_down.size(3),
              "block_connectivity: q and k_down need contiguous channels and a row stride >= d");
  TORCH_CHECK(block_size >= 1, "block_connectivity: block_size must be >= 1, got ", block_size);
  TORCH_CHECK(kept >= 1 && kept <= basis_tiles.size(1), "block_connectivity: kept must be in 1..",
              basis_tiles.size(1), ", got ", kept);
  const int64_t query_tiles = (q.size(2) + block_size - 1) / block_size;
  at::Tensor chosen = at::empty({q.size(0), q.size(1), query_tiles, kept}, q.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_connectivity", [&] {
    predict_tiles<scalar_t>(q, k_down, basis_tiles, tau, block_size, kept, chosen);
  });
  return chosen;
}

}  // namespace

TORCH_LIBRARY(structformer, m) {
  m.def("block_connectivity(Tensor q, Tensor k_down, Tensor basis_tiles, float tau, int block_size, int kept) -> Tensor");
  m.def("block_tile_attention(Tensor q, Tensor k, Tensor v, Tensor block_indices, int block_size, float scale, int dense_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(structformer, CPU, m) {
  m.impl("block_tile_attention", &block_tile_attention);
  m.impl("block_connectivity", &block_connectivity);
}
