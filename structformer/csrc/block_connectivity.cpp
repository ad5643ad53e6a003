// Sparsifiner's block connectivity predictor on the CPU (Eq. 1–3 on tile means, then the top tiles), the
// op block_connectivity. Once per call, the key-tile means of W̃_up = W_up ⊙ 1[|W_up| ≥ t] (Eq. 3) [p × kt]; then
// for every (batch, head) in parallel: K_down = W_down K [p × d], A_down = softmax(scale · Q K_downᵀ) [n × p]
// (Eq. 1), Ã_down = A_down ⊙ 1[A_down > τ] (Eq. 2), its means over query tiles [qt × p] times the basis means
// [p × kt], then the `kept` highest key tiles of each query tile, ties to the lower tile (as top_tiles' stable
// sort). Its reference is down_projected_keys + pooled_block_scores + top_tiles (tests/test_sparsifiner_kernel.py).
// Everything the predictor does per call is here, in one op: as separate torch ops (the down projection, the
// basis threshold and pooling) the predictor spent more time between its products than in them.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "tile_common.h"

namespace {
using structformer_tiles::gemm;

// The key-tile means of W̃_up, row-major [p, key tiles]: full tiles' means, and a partial last tile of r < bs keys
// shrunk toward the row's mean over all n keys, μ + √(r/bs)·(mean_r − μ) (`_key_tile_pooling`, the reference).
// The threshold is the reference's product w · 1[|w| ≥ t] (t rounded to T first, as torch compares a tensor with a
// number), so signed zeros and NaN come out as they do there.
template <typename T>
std::vector<T> pooled_up_basis(const at::Tensor& w_up, double up_threshold, int64_t bs) {
  const int64_t p = w_up.size(0), n = w_up.size(1), key_tiles = (n + bs - 1) / bs, partial = n % bs;
  const T threshold = T(up_threshold);
  const T* w = w_up.data_ptr<T>();
  std::vector<T> basis(p * key_tiles, T(0));
  for (int64_t c = 0; c < p; ++c) {
    T* row = basis.data() + c * key_tiles;
    T total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T kept = w[c * n + i] * T(std::abs(w[c * n + i]) >= threshold);
      row[i / bs] += kept;
      total += kept;
    }
    for (int64_t j = 0; j < key_tiles; ++j) row[j] /= T(std::min(bs, n - j * bs));
    if (partial) {
      const T shrink = T(std::sqrt(double(partial) / double(bs)));
      row[key_tiles - 1] = shrink * row[key_tiles - 1] + (T(1) - shrink) * (total / T(n));
    }
  }
  return basis;
}

template <typename T>
void predict_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w_down, const std::vector<T>& basis,
                   double scale, double tau, int64_t bs, int64_t kept, at::Tensor& chosen) {
  const int64_t batch = q.size(0), heads = q.size(1), n = q.size(2), dp = q.size(3), p = w_down.size(0);
  const int64_t n_k = k.size(2), query_tiles = (n + bs - 1) / bs, key_tiles = (n_k + bs - 1) / bs;
  const T* wd = w_down.data_ptr<T>();
  int64_t* out = chosen.data_ptr<int64_t>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> k_down(p * dp), coefficients(n * p), pooled(query_tiles * p), scores(key_tiles);
    std::vector<int64_t> order(key_tiles);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      const T* qs = q.data_ptr<T>() + b * q.stride(0) + h * q.stride(1);
      const T* ks = k.data_ptr<T>() + b * k.stride(0) + h * k.stride(1);
      // K_down row-major [p, d] = column-major [d, p] = K (column-major d × n_k) · W_downᵀ (column-major n_k × p)
      gemm<T>('N', 'N', dp, p, n_k, T(1), ks, k.stride(2), wd, n_k, T(0), k_down.data(), dp);
      // A_down logits row-major [n, p] = column-major [p, n] = scale · K_down (column-major d × p, transposed) · Qᵀ
      gemm<T>('T', 'N', p, n, dp, T(scale), k_down.data(), dp, qs, q.stride(2), T(0), coefficients.data(), p);
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

at::Tensor block_connectivity(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w_down,
                              const at::Tensor& w_up, double scale, double tau, double up_threshold,
                              int64_t block_size, int64_t kept) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && w_down.device().is_cpu() && w_up.device().is_cpu(),
              "block_connectivity: q, k, w_down and w_up must be CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && w_down.dim() == 2 && w_up.dim() == 2,
              "block_connectivity: q [B, H, n, d], k [B, H, n, d], w_down [p, n] and w_up [p, n] expected");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == w_down.scalar_type() &&
                  q.scalar_type() == w_up.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "block_connectivity: q, k, w_down, w_up must all be float32 or all float64");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3) &&
                  w_down.size(1) == k.size(2) && w_up.sizes() == w_down.sizes() && w_down.is_contiguous() &&
                  w_up.is_contiguous(),
              "block_connectivity: shapes q ", q.sizes(), ", k ", k.sizes(), ", w_down ", w_down.sizes(), ", w_up ",
              w_up.sizes(), " do not fit (contiguous bases [p, keys])");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && q.stride(2) >= q.size(3) && k.stride(2) >= k.size(3),
              "block_connectivity: q and k need contiguous channels and a row stride >= d");
  TORCH_CHECK(block_size >= 1, "block_connectivity: block_size must be >= 1, got ", block_size);
  const int64_t key_tiles = (k.size(2) + block_size - 1) / block_size;
  TORCH_CHECK(kept >= 1 && kept <= key_tiles, "block_connectivity: kept must be in 1..", key_tiles, ", got ", kept);
  const int64_t query_tiles = (q.size(2) + block_size - 1) / block_size;
  at::Tensor chosen = at::empty({q.size(0), q.size(1), query_tiles, kept}, q.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_connectivity", [&] {
    const std::vector<scalar_t> basis = pooled_up_basis<scalar_t>(w_up, up_threshold, block_size);
    predict_tiles<scalar_t>(q, k, w_down, basis, scale, tau, block_size, kept, chosen);
  });
  return chosen;
}

}  // namespace

TORCH_LIBRARY_IMPL(structformer, CPU, m) {
  m.impl("block_connectivity", &block_connectivity);
}
