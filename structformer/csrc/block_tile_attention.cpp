// Sparsifiner's attention on a block connectivity (Eq. 4–6 on whole kept key tiles) on the CPU: the op
// block_tile_attention, and the library's schema (the predictor is block_connectivity.cpp, the backward
// block_tile_attention_backward.cpp).
//
// For every (batch, head, query tile I) with kept key tiles J ∈ block_indices[b, h, I]:
//     S_J = scale · Q_I K_Jᵀ          one BLAS GEMM per kept tile, read where the tile lies in K (no copy)
//     P   = softmax([S_J1 … S_Jk])    ATen's vectorised softmax over the row of kept keys
//     O_I = Σ_J P_J V_J               one accumulating GEMM per kept tile
// Query tiles run in parallel (at::parallel_for), each on a bs × kept·bs score buffer that stays in cache.
// A partial last key tile enters with its real keys only, a partial last query tile with its real rows.
// The first `dense_rows` queries (the cls token's row) attend to every key instead: one more task per
// (batch, head), and the tiles leave those rows to it. The slow, obvious reference is
// structformer.functional.sparsifiner.masked_attention on block_indices_to_mask (tests/test_sparsifiner_kernel.py).
//
// Why by hand: torch's fused CPU attention takes no tile list, and FlexAttention compiled for the CPU ran at
// 0.95x dense SDPA on these masks (docs/sparsifiner.md); gathering the tiles first copies 5 MB per layer at
// n = 577. The GEMMs are MKL's, exported by libtorch_cpu (Fortran sgemm_/dgemm_); the softmax is ATen's.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "tile_common.h"

namespace structformer_tiles {

void check_tile_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& block_indices, int64_t block_size, int64_t dense_rows) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && block_indices.device().is_cpu(),
              op, ": q, k, v and block_indices must be CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be [B, H, n, d]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              op, ": q, k, v must all be float32 or all float64, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              op, ": q [B, H, n, d], k and v [B, H, m, d] expected, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  // BLAS reads each row at a stride of at least its width (lda >= d): channels contiguous, rows apart
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && q.stride(2) >= q.size(3) &&
                  k.stride(2) >= k.size(3) && v.stride(2) >= v.size(3),
              op, ": q, k, v need contiguous channels and a token stride >= d");
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  TORCH_CHECK(dense_rows >= 0 && dense_rows <= q.size(2), op, ": dense_rows must be in 0..", q.size(2), ", got ",
              dense_rows);
  const int64_t query_tiles = (q.size(2) + block_size - 1) / block_size;
  const int64_t key_tiles = (k.size(2) + block_size - 1) / block_size;
  TORCH_CHECK(block_indices.scalar_type() == at::kLong && block_indices.is_contiguous() && block_indices.dim() == 4 &&
                  block_indices.size(0) == q.size(0) && block_indices.size(1) == q.size(1) &&
                  block_indices.size(2) == query_tiles && block_indices.size(3) >= 1 &&
                  block_indices.size(3) <= key_tiles,
              op, ": block_indices must be contiguous int64 [B, H, ", query_tiles, " query tiles, 1..", key_tiles,
              " kept tiles], got ", block_indices.sizes());
  const int64_t kept = block_indices.size(3);
  const int64_t* chosen = block_indices.data_ptr<int64_t>();
  for (int64_t row = 0; row < block_indices.numel() / kept; ++row) {
    const int64_t* keys = chosen + row * kept;
    for (int64_t j = 0; j < kept; ++j) {
      TORCH_CHECK(keys[j] >= 0 && keys[j] < key_tiles, op, ": block index ", keys[j], " out of range; accepted 0..",
                  key_tiles - 1);
      for (int64_t i = 0; i < j; ++i)
        TORCH_CHECK(keys[i] != keys[j], op, ": key tile ", keys[j], " kept twice in one row");
    }
  }
}

}  // namespace structformer_tiles

namespace {
using namespace structformer_tiles;

// O [rows, d] = P V over the kept tiles: O_Iᵀ = Σ_J V_Jᵀ P_Jᵀ in column-major terms, V_J stored as d × len.
template <typename T>
void tile_values(const Rows<T>& vs, const Rows<T>& os, const int64_t* keys, int64_t kept, int64_t bs, int64_t n_k,
                 int64_t d, int64_t first, int64_t rows, const T* probabilities, int64_t width) {
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t start = keys[j] * bs, len = std::min(bs, n_k - start);
    gemm<T>('N', 'N', d, rows, len, T(1), vs.row(start), vs.row_stride, probabilities + j * bs, width, T(j ? 1 : 0),
            os.row(first), os.row_stride);
  }
}

template <typename T>
void attend_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& block_indices,
                  int64_t bs, double scale, int64_t dense_rows, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), n_q = q.size(2), d = q.size(3), n_k = k.size(2);
  const int64_t tiles = block_indices.size(2), kept = block_indices.size(3), width = kept * bs;
  const int64_t* chosen = block_indices.data_ptr<int64_t>();
  const int64_t per_head = tiles + (dense_rows > 0);      // the query tiles, then the dense rows' task
  const int64_t all_keys[1] = {0};                        // the dense rows: one "tile" of every key
  at::parallel_for(0, batch * heads * per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (heads * per_head), h = task / per_head % heads, tile = task % per_head;
      const Rows<T> qs = head_rows<T>(q, b, h), ks = head_rows<T>(k, b, h), vs = head_rows<T>(v, b, h),
                    os = head_rows<T>(out, b, h);
      const bool dense = tile == tiles;
      const QueryTile rows = dense ? QueryTile{0, dense_rows} : query_tile(tile, bs, n_q, dense_rows);
      if (rows.rows <= 0) continue;                        // a tile of dense rows only
      const int64_t* keys = dense ? all_keys : chosen + ((b * heads + h) * tiles + tile) * kept;
      const int64_t group = dense ? n_k : bs, count = dense ? 1 : kept, span = dense ? n_k : width;
      buffer.resize(std::max<size_t>(buffer.size(), rows.rows * span));
      tile_probabilities<T>(qs, ks, keys, count, group, n_k, d, scale, rows.first, rows.rows, buffer.data(), span, q);
      tile_values<T>(vs, os, keys, count, group, n_k, d, rows.first, rows.rows, buffer.data(), span);
    }
  });
}

at::Tensor block_tile_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& block_indices, int64_t block_size, double scale,
                                int64_t dense_rows) {
  check_tile_inputs("block_tile_attention", q, k, v, block_indices, block_size, dense_rows);
  // [B, n, H, d] memory seen as [B, H, n, d]: merging the heads afterwards is a view, not a copy
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).permute({0, 2, 1, 3});
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_tile_attention", [&] {
    attend_tiles<scalar_t>(q, k, v, block_indices, block_size, scale, dense_rows, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(structformer, m) {
  m.def("block_tile_attention(Tensor q, Tensor k, Tensor v, Tensor block_indices, int block_size, float scale, "
        "int dense_rows) -> Tensor");
  m.def("block_tile_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, "
        "Tensor block_indices, int block_size, float scale, int dense_rows) -> (Tensor, Tensor, Tensor)");
  m.def("block_connectivity(Tensor q, Tensor k, Tensor w_down, Tensor w_up, float scale, float tau, "
        "float up_threshold, int block_size, int kept) -> Tensor");
}

TORCH_LIBRARY_IMPL(structformer, CPU, m) {
  m.impl("block_tile_attention", &block_tile_attention);
}
