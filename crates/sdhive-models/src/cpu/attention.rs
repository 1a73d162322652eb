//! Multi-head attention straight from the projections' `(B, S, H·D)` layout: each (sample, head,
//! block of queries) task multiplies strided views of q and k into a score block that fits in L2,
//! applies the softmax in place and multiplies by v's strided view directly into the head's
//! columns of the `(B, Sq, H·Dv)` output. No head split/merge copies, no full score tensor.

use super::gemm::{matmul, matmul_raw, Mat};
use super::math;
use rayon::prelude::*;

/// Score elements per task (1 MB): small enough for L2, large enough for efficient products.
const SCORE_BLOCK: usize = 1 << 18;

/// The output pointer shared by tasks that write disjoint elements.
struct OutPtr(*mut f32);
// SAFETY: tasks write pairwise disjoint elements (distinct heads or query rows) and the buffer
// outlives the parallel loop.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnShape {
    pub batch: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub v_head_dim: usize,
}

/// `softmax(q kᵀ · scale) v` per head; `q` `(B, Sq, H·D)`, `k` `(B, Sk, H·D)`, `v` `(B, Sk, H·Dv)`.
pub(crate) fn attention(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape, scale: f32) -> Vec<f32> {
    let (sq, sk, d, dv) = (s.q_len, s.kv_len, s.head_dim, s.v_head_dim);
    let (hd, hdv) = (s.heads * d, s.heads * dv);
    let mut out = vec![0f32; s.batch * sq * hdv];
    if out.is_empty() {
        return out;
    }
    assert!(
        q.len() >= s.batch * sq * hd && k.len() >= s.batch * sk * hd && v.len() >= s.batch * sk * hdv,
        "attention: inputs smaller than {s:?}"
    );
    let block = (SCORE_BLOCK / sk.max(1)).clamp(1, sq);
    let blocks = sq.div_ceil(block);
    let tasks = s.batch * s.heads * blocks;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..tasks).into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, t| {
        let (bh, qi) = (t / blocks, t % blocks);
        let (b, h) = (bh / s.heads, bh % s.heads);
        let q0 = qi * block;
        let rows = block.min(sq - q0);
        scores.resize(rows * sk, 0.0);
        let q_mat = Mat::rows((b * sq + q0) * hd + h * d, rows, d, hd);
        let kt_mat = Mat::rows(b * sk * hd + h * d, sk, d, hd).t();
        let score_mat = Mat::rows(0, rows, sk, sk);
        matmul(scores, score_mat, false, q, q_mat, k, kt_mat, scale, 1);
        math::softmax_rows(&mut scores[..rows * sk], sk);
        let v_mat = Mat::rows(b * sk * hdv + h * dv, sk, dv, hdv);
        let o_mat = Mat::rows((b * sq + q0) * hdv + h * dv, rows, dv, hdv);
        // SAFETY: `o_mat` lies inside `out` (b < B, q0 + rows ≤ Sq, h·Dv + Dv ≤ H·Dv) and no
        // other task has the same (b, h, query block), so the elements written are exclusive.
        unsafe { matmul_raw(out_ptr.get(), o_mat, false, scores, score_mat, v, v_mat, 1.0, 1) };
    });
    out
}
