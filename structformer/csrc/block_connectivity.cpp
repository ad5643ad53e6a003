// Sparsifiner's block connectivity predictor on the CPU (Eq. 1–3 on tile means, then the top tiles), the
// op block_connectivity. For every (batch, head) in parallel: A_down = softmax(Q K_downᵀ) [n × p] (K_down =
// W_down K, scaled), Ã_down = A_down ⊙ 1[A_down > τ], its means over query tiles [qt × p] times the key-tile
// means of W̃_up [p × kt], then the `kept` highest key tiles of each query tile, ties to the lower tile (as
// top_tiles' stable sort). Its reference is pooled_block_scores + top_tiles (tests/test_sparsifiner_kernel.py).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "tile_common.h"

namespace {
using structformer_tiles::gemm;

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

TORCH_LIBRARY_IMPL(structformer, CPU, m) {
  m.impl("block_connectivity", &block_connectivity);
}
