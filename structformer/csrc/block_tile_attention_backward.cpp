// The backward of block_tile_attention (Eq. 4–6 on kept key tiles), the op block_tile_attention_backward:
// given dO, the gradients of q, k and v, in two parallel passes over disjoint outputs.
//
//   1. per query group (a query tile, or the dense rows on every key): P recomputed as in the forward,
//      dP = dO Vᵀ, dS = P ⊙ (dP − rowsum(dO ⊙ O)) (the softmax's backward), dQ = scale · dS K;
//      P and dS are kept for pass 2.
//   2. per key tile J: dK_J = scale · Σ dS_Jᵀ Q and dV_J = Σ P_Jᵀ dO over the query groups that kept J
//      (found by scanning block_indices), so no two tasks write the same rows.
// The reference is autograd through masked_attention on block_indices_to_mask (tests, and gradcheck in float64
// of the autograd Function that calls this op).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "tile_common.h"

namespace {
using namespace structformer_tiles;

// Pass 1 for one query group: fills P and dS [rows, width] and writes dQ for its rows.
template <typename T>
void query_gradients(const Rows<T>& qs, const Rows<T>& ks, const Rows<T>& vs, const Rows<T>& os, const Rows<T>& dos,
                     const Rows<T>& dqs, const int64_t* keys, int64_t kept, int64_t bs, int64_t n_k, int64_t d,
                     double scale, QueryTile rows, T* probabilities, T* score_grads, int64_t width,
                     const at::Tensor& like) {
  tile_probabilities<T>(qs, ks, keys, kept, bs, n_k, d, scale, rows.first, rows.rows, probabilities, width, like);
  // dP row-major [rows, len] = column-major [len, rows]: dPᵀ = V_J · dOᵀ (as the scores, with V for K)
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t start = keys[j] * bs, len = std::min(bs, n_k - start);
    gemm<T>('T', 'N', len, rows.rows, d, T(1), vs.row(start), vs.row_stride, dos.row(rows.first), dos.row_stride, T(0),
            score_grads + j * bs, width);
    for (int64_t r = 0; r < rows.rows && len < bs; ++r)    // slots past n_k: no key, no gradient
      std::fill(score_grads + r * width + j * bs + len, score_grads + r * width + (j + 1) * bs, T(0));
  }
  for (int64_t r = 0; r < rows.rows; ++r) {
    const T* o = os.row(rows.first + r);
    const T* g = dos.row(rows.first + r);
    T dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += o[c] * g[c];
    T* ds = score_grads + r * width;
    const T* p = probabilities + r * width;
    for (int64_t c = 0; c < width; ++c) ds[c] = p[c] * (ds[c] - dot);
  }
  // dQ row-major [rows, d] = column-major [d, rows]: dQᵀ = scale · Σ_J K_Jᵀ dS_Jᵀ (as the values, with K for V)
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t start = keys[j] * bs, len = std::min(bs, n_k - start);
    gemm<T>('N', 'N', d, rows.rows, len, T(scale), ks.row(start), ks.row_stride, score_grads + j * bs, width,
            T(j ? 1 : 0), dqs.row(rows.first), dqs.row_stride);
  }
}

// Pass 2 for one key group (len keys from start): adds scale · dSᵀ Q and Pᵀ dO of one query group's slot
// range (column offset `slot` of its [rows, width] buffers) to dK and dV. Column-major: dKᵀ = scale · Qᵀ dS.
template <typename T>
void add_key_gradients(const Rows<T>& qs, const Rows<T>& dos, const Rows<T>& dks, const Rows<T>& dvs, int64_t d,
                       double scale, QueryTile rows, int64_t start, int64_t len, const T* probabilities,
                       const T* score_grads, int64_t slot, int64_t width, bool accumulate) {
  const T beta = accumulate ? T(1) : T(0);
  gemm<T>('N', 'T', d, len, rows.rows, T(scale), qs.row(rows.first), qs.row_stride, score_grads + slot, width, beta,
          dks.row(start), dks.row_stride);
  gemm<T>('N', 'T', d, len, rows.rows, T(1), dos.row(rows.first), dos.row_stride, probabilities + slot, width, beta,
          dvs.row(start), dvs.row_stride);
}

template <typename T>
void tile_gradients(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                    const at::Tensor& grad_out, const at::Tensor& block_indices, int64_t bs, double scale,
                    int64_t dense_rows, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t batch = q.size(0), heads = q.size(1), n_q = q.size(2), d = q.size(3), n_k = k.size(2);
  const int64_t tiles = block_indices.size(2), kept = block_indices.size(3), width = kept * bs;
  const int64_t key_tiles = (n_k + bs - 1) / bs;
  const int64_t* chosen = block_indices.data_ptr<int64_t>();
  const int64_t all_keys[1] = {0};
  const int64_t heads_total = batch * heads, dense = std::min(dense_rows, n_q);
  // P and dS of every query tile [B·H·tiles, bs, width] and of the dense rows [B·H, dense, n_k]
  std::vector<T> tile_p(heads_total * tiles * bs * width), tile_ds(tile_p.size());
  std::vector<T> dense_p(heads_total * dense * n_k), dense_ds(dense_p.size());
  const int64_t per_head = tiles + (dense > 0);
  at::parallel_for(0, heads_total * per_head, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / per_head, b = bh / heads, h = bh % heads, tile = task % per_head;
      const bool is_dense = tile == tiles;
      const QueryTile rows = is_dense ? QueryTile{0, dense} : query_tile(tile, bs, n_q, dense_rows);
      if (rows.rows <= 0) continue;
      const int64_t* keys = is_dense ? all_keys : chosen + (bh * tiles + tile) * kept;
      T* p = is_dense ? dense_p.data() + bh * dense * n_k : tile_p.data() + (bh * tiles + tile) * bs * width;
      T* ds = is_dense ? dense_ds.data() + bh * dense * n_k : tile_ds.data() + (bh * tiles + tile) * bs * width;
      query_gradients<T>(head_rows<T>(q, b, h), head_rows<T>(k, b, h), head_rows<T>(v, b, h), head_rows<T>(out, b, h),
                         head_rows<T>(grad_out, b, h), head_rows<T>(dq, b, h), keys, is_dense ? 1 : kept,
                         is_dense ? n_k : bs, n_k, d, scale, rows, p, ds, is_dense ? n_k : width, q);
    }
  });
  at::parallel_for(0, heads_total * key_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / key_tiles, b = bh / heads, h = bh % heads, key_tile = task % key_tiles;
      const int64_t start = key_tile * bs, len = std::min(bs, n_k - start);
      const Rows<T> qs = head_rows<T>(q, b, h), dos = head_rows<T>(grad_out, b, h), dks = head_rows<T>(dk, b, h),
                    dvs = head_rows<T>(dv, b, h);
      bool written = false;
      if (dense > 0) {
        add_key_gradients<T>(qs, dos, dks, dvs, d, scale, QueryTile{0, dense}, start, len,
                             dense_p.data() + bh * dense * n_k, dense_ds.data() + bh * dense * n_k, start, n_k, false);
        written = true;
      }
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const QueryTile rows = query_tile(tile, bs, n_q, dense_rows);
        if (rows.rows <= 0) continue;
        const int64_t* keys = chosen + (bh * tiles + tile) * kept;
        for (int64_t j = 0; j < kept; ++j) {
          if (keys[j] != key_tile) continue;
          const int64_t offset = (bh * tiles + tile) * bs * width;
          add_key_gradients<T>(qs, dos, dks, dvs, d, scale, rows, start, len, tile_p.data() + offset,
                               tile_ds.data() + offset, j * bs, width, written);
          written = true;
        }
      }
      if (!written)                                        // a key tile no query kept: zero gradient
        for (int64_t r = 0; r < len; ++r) {
          std::fill(dks.row(start + r), dks.row(start + r) + d, T(0));
          std::fill(dvs.row(start + r), dvs.row(start + r) + d, T(0));
        }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_tile_attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& grad_out,
    const at::Tensor& block_indices, int64_t block_size, double scale, int64_t dense_rows) {
  check_tile_inputs("block_tile_attention_backward", q, k, v, block_indices, block_size, dense_rows);
  TORCH_CHECK(out.sizes() == q.sizes() && grad_out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  grad_out.scalar_type() == q.scalar_type() && out.stride(3) == 1 && grad_out.stride(3) == 1 &&
                  out.stride(2) >= q.size(3) && grad_out.stride(2) >= q.size(3),
              "block_tile_attention_backward: out and grad_out must be q's shape and dtype with contiguous channels");
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous), dk = at::empty_like(k, at::MemoryFormat::Contiguous),
             dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_tile_attention_backward", [&] {
    tile_gradients<scalar_t>(q, k, v, out, grad_out, block_indices, block_size, scale, dense_rows, dq, dk, dv);
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(structformer, CPU, m) {
  m.impl("block_tile_attention_backward", &block_tile_attention_backward);
}
