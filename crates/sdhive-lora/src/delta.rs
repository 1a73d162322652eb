//! The weight update ΔW of one module, following A1111's extensions-builtin/Lora formulas (network_lora.py,
//! network_hada.py, network_lokr.py, lyco_helpers.py, network.py's `calc_scale` / `finalize_updown`) so that a
//! LoRA changes an image here exactly as it does there. Also each module's "natural" update shape, which lets a
//! model mismatch be found from the file's shapes alone, before anything is computed.

use crate::names::Rows;
use candle_core::{Device, Tensor};

/// A LoKr factor: stored whole, or as the product of two low-rank matrices.
#[derive(Debug, Clone)]
pub(crate) enum Factor {
    Full(Tensor),
    Product(Tensor, Tensor),
}

/// The tensors of one module, f32 on the CPU.
#[derive(Debug, Clone)]
pub(crate) enum Weights {
    Lora { up: Tensor, down: Tensor, mid: Option<Tensor> },
    LoHa { w1a: Tensor, w1b: Tensor, w2a: Tensor, w2b: Tensor, t1: Option<Tensor>, t2: Option<Tensor> },
    LoKr { w1: Factor, w2: Factor, t2: Option<Tensor> },
}

/// Which kind of network a module is, as A1111 classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleKind {
    /// `lora_up`/`lora_down` (kohya LoRA, LoCon, diffusers/PEFT `lora_B`/`lora_A`); `tucker` when `lora_mid` is
    /// present (LoCon's CP decomposition of a conv kernel).
    Lora { tucker: bool },
    /// LyCORIS LoHa (Hadamard product of two low-rank products); `tucker` when `hada_t1`/`hada_t2` are present.
    LoHa { tucker: bool },
    /// LyCORIS LoKr (Kronecker product of two factors).
    LoKr,
}

fn numel(d: &[usize]) -> usize {
    d.iter().product()
}

/// Columns of `t` viewed as a matrix of `dims[0]` rows, as torch's `reshape(t.size(0), -1)`.
fn cols(d: &[usize]) -> usize {
    match d.first() {
        Some(&0) | None => 0,
        Some(&rows) => numel(d) / rows,
    }
}

fn need(ok: bool, reason: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(reason())
    }
}

fn at_least_2d(name: &str, d: &[usize]) -> Result<(), String> {
    need(d.len() >= 2 && !d.contains(&0), || {
        format!("{name} has shape {d:?}; a non-empty matrix or kernel is needed")
    })
}

fn is_4d(name: &str, d: &[usize]) -> Result<(), String> {
    need(d.len() == 4, || format!("{name} has shape {d:?}; a 4-D tucker core is needed"))
}

fn matrix(name: &str, d: &[usize]) -> Result<(), String> {
    need(d.len() == 2 && !d.contains(&0), || format!("{name} has shape {d:?}; a 2-D matrix is needed"))
}

/// Shape of `make_weight_cp(t, wa, wb)`: `[wa.1, wb.1, t.2, t.3]`.
fn cp_shape(t: &[usize], wa: &[usize], wb: &[usize], names: [&str; 3]) -> Result<Vec<usize>, String> {
    is_4d(names[0], t)?;
    matrix(names[1], wa)?;
    matrix(names[2], wb)?;
    need(t[0] == wa[0] && t[1] == wb[0], || {
        format!("{} {t:?} does not match {} {wa:?} and {} {wb:?}", names[0], names[1], names[2])
    })?;
    Ok(vec![wa[1], wb[1], t[2], t[3]])
}

/// Shape of `rebuild_conventional(a, b, ...)` before the final reshape: `[a.0, b.1]` plus b's kernel dimensions
/// when b is 4-D, checking that the inner dimensions agree.
fn product_shape(a: &[usize], b: &[usize], names: [&str; 2]) -> Result<Vec<usize>, String> {
    at_least_2d(names[0], a)?;
    at_least_2d(names[1], b)?;
    need(cols(a) == b[0], || format!("{} {a:?} and {} {b:?} do not multiply", names[0], names[1]))?;
    let mut shape = vec![a[0], b[1]];
    if b.len() == 4 {
        shape.extend_from_slice(&b[2..]);
    } else if b.len() != 2 {
        shape[1] = cols(b);
    }
    Ok(shape)
}

impl Weights {
    pub(crate) fn kind(&self) -> ModuleKind {
        match self {
            Weights::Lora { mid, .. } => ModuleKind::Lora { tucker: mid.is_some() },
            Weights::LoHa { t1, t2, .. } => ModuleKind::LoHa { tucker: t1.is_some() || t2.is_some() },
            Weights::LoKr { .. } => ModuleKind::LoKr,
        }
    }

    /// The `dim` A1111 divides alpha by; `None` where it has none (LoKr with both factors whole), which makes the
    /// scale 1.
    pub(crate) fn rank(&self) -> Option<usize> {
        match self {
            Weights::Lora { down, .. } => Some(down.dims()[0]),
            Weights::LoHa { w1b, .. } => Some(w1b.dims()[0]),
            // A1111 sets dim from w1_b and then overwrites it from w2_b; LyCORIS writes the same rank to both.
            Weights::LoKr { w1, w2, .. } => match (w2, w1) {
                (Factor::Product(_, b), _) | (Factor::Full(_), Factor::Product(_, b)) => Some(b.dims()[0]),
                (Factor::Full(_), Factor::Full(_)) => None,
            },
        }
    }

    /// The update's shape as A1111 builds it (`output_shape`), validated from the tensor shapes; the final reshape
    /// to the target only needs the element count to agree.
    pub(crate) fn natural_shape(&self) -> Result<Vec<usize>, String> {
        match self {
            Weights::Lora { up, down, mid } => {
                let (up, down) = (up.dims(), down.dims());
                at_least_2d("lora_up", up)?;
                at_least_2d("lora_down", down)?;
                match mid {
                    None => product_shape(up, down, ["lora_up", "lora_down"]),
                    Some(mid) => {
                        let mid = mid.dims();
                        is_4d("lora_mid", mid)?;
                        need(cols(up) == mid[0] && down[0] == mid[1], || {
                            format!("lora_mid {mid:?} does not match lora_up {up:?} and lora_down {down:?}")
                        })?;
                        Ok(vec![up[0], cols(down), mid[2], mid[3]])
                    }
                }
            }
            Weights::LoHa { w1a, w1b, w2a, w2b, t1, t2 } => {
                let first = match t1 {
                    Some(t1) => {
                        cp_shape(t1.dims(), w1a.dims(), w1b.dims(), ["hada_t1", "hada_w1_a", "hada_w1_b"])?
                    }
                    None => product_shape(w1a.dims(), w1b.dims(), ["hada_w1_a", "hada_w1_b"])?,
                };
                let second = match t2 {
                    Some(t2) => {
                        cp_shape(t2.dims(), w2a.dims(), w2b.dims(), ["hada_t2", "hada_w2_a", "hada_w2_b"])?
                    }
                    None => product_shape(w2a.dims(), w2b.dims(), ["hada_w2_a", "hada_w2_b"])?,
                };
                need(numel(&first) == numel(&second), || {
                    format!("the hada_w1 product {first:?} and the hada_w2 product {second:?} differ in size")
                })?;
                Ok(first)
            }
            Weights::LoKr { w1, w2, t2 } => {
                let w1 = match w1 {
                    Factor::Full(w) => {
                        matrix("lokr_w1", w.dims())?;
                        w.dims().to_vec()
                    }
                    Factor::Product(a, b) => {
                        matrix("lokr_w1_a", a.dims())?;
                        matrix("lokr_w1_b", b.dims())?;
                        product_shape(a.dims(), b.dims(), ["lokr_w1_a", "lokr_w1_b"])?
                    }
                };
                let w2 = match (w2, t2) {
                    (Factor::Full(w), None) => {
                        at_least_2d("lokr_w2", w.dims())?;
                        need(matches!(w.dims().len(), 2 | 4), || {
                            format!("lokr_w2 has shape {:?}", w.dims())
                        })?;
                        w.dims().to_vec()
                    }
                    (Factor::Product(a, b), None) => {
                        matrix("lokr_w2_a", a.dims())?;
                        at_least_2d("lokr_w2_b", b.dims())?;
                        need(cols(a.dims()) == b.dims()[0], || {
                            format!("lokr_w2_a {:?} and lokr_w2_b {:?} do not multiply", a.dims(), b.dims())
                        })?;
                        vec![a.dims()[0], cols(b.dims())]
                    }
                    (Factor::Product(a, b), Some(t)) => {
                        cp_shape(t.dims(), a.dims(), b.dims(), ["lokr_t2", "lokr_w2_a", "lokr_w2_b"])?
                    }
                    (Factor::Full(_), Some(_)) => return Err("lokr_t2 given with a whole lokr_w2".into()),
                };
                let mut shape = vec![w1[0] * w2[0], w1[1] * w2[1]];
                shape.extend_from_slice(&w2[2..]);
                Ok(shape)
            }
        }
    }

    /// ΔW before scaling, in A1111's `output_shape` (see `natural_shape`), computed on `device`.
    pub(crate) fn update(&self, device: &Device) -> candle_core::Result<Tensor> {
        let on = |t: &Tensor| t.to_device(device)?.to_dtype(candle_core::DType::F32);
        match self {
            Weights::Lora { up, down, mid } => {
                let (up, down) = (as_matrix(&on(up)?)?, as_matrix(&on(down)?)?);
                match mid {
                    None => up.matmul(&down),
                    Some(mid) => cp(&on(mid)?, &up, &down),
                }
            }
            Weights::LoHa { w1a, w1b, w2a, w2b, t1, t2 } => {
                let half = |wa: &Tensor, wb: &Tensor, t: &Option<Tensor>| -> candle_core::Result<Tensor> {
                    let (wa, wb) = (on(wa)?, on(wb)?);
                    match t {
                        Some(t) => make_weight_cp(&on(t)?, &wa, &wb),
                        None => as_matrix(&wa)?.matmul(&as_matrix(&wb)?),
                    }
                };
                let first = half(w1a, w1b, t1)?;
                let second = half(w2a, w2b, t2)?.reshape(first.shape())?;
                first * second
            }
            Weights::LoKr { w1, w2, t2 } => {
                let w1 = match w1 {
                    Factor::Full(w) => on(w)?,
                    Factor::Product(a, b) => as_matrix(&on(a)?)?.matmul(&as_matrix(&on(b)?)?)?,
                };
                let w2 = match (w2, t2) {
                    (Factor::Full(w), _) => on(w)?,
                    (Factor::Product(a, b), Some(t)) => make_weight_cp(&on(t)?, &on(a)?, &on(b)?)?,
                    (Factor::Product(a, b), None) => as_matrix(&on(a)?)?.matmul(&as_matrix(&on(b)?)?)?,
                };
                kron(&w1, &w2)
            }
        }
    }
}

/// `t.reshape(t.size(0), -1)`.
fn as_matrix(t: &Tensor) -> candle_core::Result<Tensor> {
    let rows = t.dims()[0];
    t.reshape((rows, cols(t.dims())))?.contiguous()
}

/// `einsum('n m k l, i n, m j -> i j k l', mid, up, down)` (lyco_helpers' `rebuild_cp_decomposition`).
fn cp(mid: &Tensor, up: &Tensor, down: &Tensor) -> candle_core::Result<Tensor> {
    let (n, m, k, l) = mid.dims4()?;
    let i = up.dims()[0];
    let j = down.dims()[1];
    // Contract n first: (i, n) @ (n, m·k·l), then bring m last to contract it with down.
    let x = up.matmul(&mid.contiguous()?.reshape((n, m * k * l))?)?;
    let x = x.reshape((i, m, k * l))?.transpose(1, 2)?.contiguous()?.reshape((i * k * l, m))?;
    let x = x.matmul(down)?.reshape((i, k, l, j))?;
    x.permute((0, 3, 1, 2))?.contiguous()
}

/// lyco_helpers' `make_weight_cp`: `einsum('i j k l, j r, i p -> p r k l', t, wb, wa)`, which is `cp` with `wa`
/// transposed into the "up" role.
fn make_weight_cp(t: &Tensor, wa: &Tensor, wb: &Tensor) -> candle_core::Result<Tensor> {
    cp(t, &wa.t()?.contiguous()?, &wb.contiguous()?)
}

/// `torch.kron(w1, w2)`, with w1 given trailing unit kernel dimensions when w2 is a conv kernel (network_lokr's
/// `make_kron`).
fn kron(w1: &Tensor, w2: &Tensor) -> candle_core::Result<Tensor> {
    let (a, b) = w1.dims2()?;
    match w2.dims() {
        &[c, d] => {
            let x = w1.reshape((a, 1, b, 1))?.broadcast_mul(&w2.reshape((1, c, 1, d))?)?;
            x.reshape((a * c, b * d))
        }
        &[c, d, k, l] => {
            let x = w1
                .reshape((a, 1, b, 1, 1, 1))?
                .broadcast_mul(&w2.contiguous()?.reshape((1, c, 1, d, k, l))?)?;
            x.reshape((a * c, b * d, k, l))
        }
        other => Err(candle_core::Error::Msg(format!("lokr_w2 has shape {other:?}"))),
    }
}

/// Whether an update of `natural` shape can be applied to a weight of `target` shape: same output rows and element
/// count (A1111 reshapes by element count: linear LoRAs on 1×1 convs and the reverse occur), or a 4-channel conv
/// update on an inpainting model's 9-channel `conv_in`, which A1111 zero-pads.
pub(crate) fn fits(natural: &[usize], target: &[usize]) -> bool {
    if natural.first() != target.first() {
        return false;
    }
    numel(natural) == numel(target) || inpaint_pad(natural, target)
}

fn inpaint_pad(natural: &[usize], target: &[usize]) -> bool {
    target.len() == 4 && target[1] == 9 && numel(natural) == target[0] * 4 * target[2] * target[3]
}

/// Scales `update` and gives it exactly `target`'s shape (A1111's `finalize_updown` plus the inpainting pad).
pub(crate) fn finalize(update: Tensor, scale: f32, target: &[usize]) -> candle_core::Result<Tensor> {
    let update = (update * f64::from(scale))?;
    if update.elem_count() == numel(target) {
        return update.reshape(target);
    }
    // Only reached when `fits` said so: the extra five input channels get no update.
    update.reshape((target[0], 4, target[2], target[3]))?.pad_with_zeros(1, 0, 5)
}

/// The target's part of a module's whole update (see [`Rows`]).
fn take_rows(update: Tensor, rows: Rows) -> candle_core::Result<Tensor> {
    match rows {
        Rows::All => Ok(update),
        Rows::Slice { start, len, .. } => update.narrow(0, start, len)?.contiguous(),
        Rows::SwapHalves => {
            let half = update.dim(0)? / 2;
            Tensor::cat(&[update.narrow(0, half, half)?, update.narrow(0, 0, half)?], 0)
        }
    }
}

impl crate::LoraFile {
    /// ΔW of `patch`'s module in f32 on `device`, shaped exactly `target_shape`, including the module's scale
    /// (`scale`, else alpha/rank) but not the user's multiplier: the weight to use is `W + multiplier · ΔW`.
    pub fn delta(
        &self,
        patch: &crate::Patch,
        target_shape: &[usize],
        device: &Device,
    ) -> Result<Tensor, crate::LoraError> {
        let module = self.modules.get(patch.module).ok_or_else(|| crate::LoraError::Malformed {
            path: self.path.clone(),
            key: patch.target.clone(),
            reason: format!("patch names module {} of a file with {}", patch.module, self.modules.len()),
        })?;
        let natural = self.natural_shape(module)?;
        let update_shape = patch.rows.update_shape(target_shape);
        if !patch.rows.fit(target_shape) || !fits(&natural, &update_shape) {
            return Err(crate::LoraError::Shape {
                path: self.path.clone(),
                key: module.key.clone(),
                target: patch.target.clone(),
                expected: update_shape,
                got: natural,
            });
        }
        let compute = || {
            let update = finalize(module.weights.update(device)?, module.scale(), &update_shape)?;
            take_rows(update, patch.rows)
        };
        compute().map_err(|source| crate::LoraError::Compute {
            path: self.path.clone(),
            key: module.key.clone(),
            source: Box::new(source),
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::write_safetensors;
    use crate::{LoraError, LoraFile, Network, Patch, Rows};
    use candle_core::Device;

    type T = (&'static str, Vec<usize>, Vec<f32>);

    fn read(tensors: &[T], metadata: &[(&str, &str)]) -> (tempfile::TempDir, LoraFile) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.safetensors");
        write_safetensors(&path, tensors, metadata);
        let file = LoraFile::read(&path).unwrap();
        (dir, file)
    }

    fn delta(tensors: &[T], metadata: &[(&str, &str)], target: &[usize]) -> Vec<f32> {
        let (_dir, file) = read(tensors, metadata);
        assert_eq!(file.modules.len(), 1);
        let patch = Patch { network: Network::Unet, target: "x.weight".into(), module: 0, rows: Rows::All };
        let d = file.delta(&patch, target, &Device::Cpu).unwrap();
        assert_eq!(d.dims(), target);
        d.flatten_all().unwrap().to_vec1().unwrap()
    }

    fn close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "element {i}: got {g}, want {w}\n{got:?}\n{want:?}"
            );
        }
    }

    /// Deterministic, distinct test values.
    fn vals(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.37).sin() + 0.1 * seed).collect()
    }

    #[test]
    fn lora_linear_with_alpha_below_rank() {
        let got = delta(
            &[
                ("lora_unet_x.lora_up.weight", vec![2, 2], vec![1., 2., 3., 4.]),
                ("lora_unet_x.lora_down.weight", vec![2, 3], vec![5., 6., 7., 8., 9., 10.]),
                ("lora_unet_x.alpha", vec![], vec![1.0]),
            ],
            &[],
            &[2, 3],
        );
        // [[1,2],[3,4]] @ [[5,6,7],[8,9,10]] = [[21,24,27],[47,54,61]], times alpha/rank = 1/2.
        close(&got, &[10.5, 12., 13.5, 23.5, 27., 30.5]);
    }

    #[test]
    fn scale_tensor_replaces_alpha_over_rank() {
        let got = delta(
            &[
                ("lora_unet_x.lora_up.weight", vec![2, 1], vec![1., 2.]),
                ("lora_unet_x.lora_down.weight", vec![1, 2], vec![3., 4.]),
                ("lora_unet_x.alpha", vec![], vec![8.0]),
                ("lora_unet_x.scale", vec![], vec![0.5]),
            ],
            &[],
            &[2, 2],
        );
        close(&got, &[1.5, 2., 3., 4.]);
    }

    #[test]
    fn no_alpha_means_scale_one_and_linear_fits_1x1_conv() {
        let got = delta(
            &[
                ("lora_unet_x.lora_up.weight", vec![2, 1], vec![1., 2.]),
                ("lora_unet_x.lora_down.weight", vec![1, 2], vec![3., 4.]),
            ],
            &[],
            &[2, 2, 1, 1],
        );
        close(&got, &[3., 4., 6., 8.]);
    }

    #[test]
    fn locon_conv_kernel() {
        let down = vals(2 * 2 * 3 * 3, 1.0);
        let up = vals(3 * 2, 2.0);
        let got = delta(
            &[
                ("lora_unet_x.lora_up.weight", vec![3, 2, 1, 1], up.clone()),
                ("lora_unet_x.lora_down.weight", vec![2, 2, 3, 3], down.clone()),
                ("lora_unet_x.alpha", vec![], vec![1.0]),
            ],
            &[],
            &[3, 2, 3, 3],
        );
        let mut want = vec![0f32; 3 * 2 * 9];
        for o in 0..3 {
            for c in 0..2 {
                for s in 0..9 {
                    let mut acc = 0.0;
                    for r in 0..2 {
                        acc += up[o * 2 + r] * down[(r * 2 + c) * 9 + s];
                    }
                    want[(o * 2 + c) * 9 + s] = acc * 0.5;
                }
            }
        }
        close(&got, &want);
    }

    #[test]
    fn locon_tucker_mid() {
        // up (out 3, rank 2), down (rank 2, in 4), mid (2, 2, 2, 3).
        let (up, down, mid) = (vals(6, 1.0), vals(8, 2.0), vals(2 * 2 * 2 * 3, 3.0));
        let got = delta(
            &[
                ("lora_unet_x.lora_up.weight", vec![3, 2, 1, 1], up.clone()),
                ("lora_unet_x.lora_down.weight", vec![2, 4, 1, 1], down.clone()),
                ("lora_unet_x.lora_mid.weight", vec![2, 2, 2, 3], mid.clone()),
                ("lora_unet_x.alpha", vec![], vec![4.0]),
            ],
            &[],
            &[3, 4, 2, 3],
        );
        // einsum('n m k l, i n, m j -> i j k l') with scale alpha/rank = 2.
        let mut want = vec![0f32; 3 * 4 * 6];
        for i in 0..3 {
            for j in 0..4 {
                for kl in 0..6 {
                    let mut acc = 0.0;
                    for n in 0..2 {
                        for m in 0..2 {
                            acc += mid[(n * 2 + m) * 6 + kl] * up[i * 2 + n] * down[m * 4 + j];
                        }
                    }
                    want[(i * 4 + j) * 6 + kl] = 2.0 * acc;
                }
            }
        }
        close(&got, &want);
    }

    #[test]
    fn loha_hadamard_of_two_products() {
        let got = delta(
            &[
                ("lora_unet_x.hada_w1_a", vec![2, 1], vec![1., 2.]),
                ("lora_unet_x.hada_w1_b", vec![1, 2], vec![3., 4.]),
                ("lora_unet_x.hada_w2_a", vec![2, 1], vec![1., -1.]),
                ("lora_unet_x.hada_w2_b", vec![1, 2], vec![2., 5.]),
                ("lora_unet_x.alpha", vec![], vec![2.0]),
            ],
            &[],
            &[2, 2],
        );
        // [[3,4],[6,8]] ⊙ [[2,5],[-2,-5]] = [[6,20],[-12,-40]], times alpha/dim = 2/1.
        close(&got, &[12., 40., -24., -80.]);
    }

    #[test]
    fn loha_tucker() {
        // wa (rank 2, out 2), wb (rank 2, in 3), t (2, 2, 1, 2).
        let (w1a, w1b, t1) = (vals(4, 1.0), vals(6, 2.0), vals(8, 3.0));
        let (w2a, w2b, t2) = (vals(4, 4.0), vals(6, 5.0), vals(8, 6.0));
        let got = delta(
            &[
                ("lora_unet_x.hada_w1_a", vec![2, 2], w1a.clone()),
                ("lora_unet_x.hada_w1_b", vec![2, 3], w1b.clone()),
                ("lora_unet_x.hada_t1", vec![2, 2, 1, 2], t1.clone()),
                ("lora_unet_x.hada_w2_a", vec![2, 2], w2a.clone()),
                ("lora_unet_x.hada_w2_b", vec![2, 3], w2b.clone()),
                ("lora_unet_x.hada_t2", vec![2, 2, 1, 2], t2.clone()),
                ("lora_unet_x.alpha", vec![], vec![1.0]),
            ],
            &[],
            &[2, 3, 1, 2],
        );
        // einsum('i j k l, j r, i p -> p r k l', t, wb, wa) for each half.
        let cp = |t: &[f32], wa: &[f32], wb: &[f32], p: usize, r: usize, kl: usize| {
            let mut acc = 0.0;
            for i in 0..2 {
                for j in 0..2 {
                    acc += t[(i * 2 + j) * 2 + kl] * wb[j * 3 + r] * wa[i * 2 + p];
                }
            }
            acc
        };
        let mut want = vec![];
        for p in 0..2 {
            for r in 0..3 {
                for kl in 0..2 {
                    want.push(cp(&t1, &w1a, &w1b, p, r, kl) * cp(&t2, &w2a, &w2b, p, r, kl) * 0.5);
                }
            }
        }
        close(&got, &want);
    }

    #[test]
    fn lokr_kronecker() {
        let got = delta(
            &[
                ("lora_unet_x.lokr_w1", vec![2, 2], vec![1., 2., 3., 4.]),
                ("lora_unet_x.lokr_w2", vec![2, 1], vec![5., 6.]),
                ("lora_unet_x.alpha", vec![], vec![7.0]),
            ],
            &[],
            &[4, 2],
        );
        // kron([[1,2],[3,4]], [[5],[6]]); both factors whole, so no rank and scale 1 whatever alpha says.
        close(&got, &[5., 10., 6., 12., 15., 20., 18., 24.]);

        let got = delta(
            &[
                ("lora_unet_x.lokr_w1", vec![2, 2], vec![1., 2., 3., 4.]),
                ("lora_unet_x.lokr_w2_a", vec![2, 1], vec![1., 2.]),
                ("lora_unet_x.lokr_w2_b", vec![1, 1], vec![3.]),
                ("lora_unet_x.alpha", vec![], vec![2.0]),
            ],
            &[],
            &[4, 2],
        );
        // w2 = [[3],[6]], scale alpha / w2_b rank = 2.
        close(&got, &[6., 12., 12., 24., 18., 24., 36., 48.]);
    }

    #[test]
    fn lokr_conv_kernel() {
        let w1 = vec![1., -2.];
        let w2 = vals(2 * 3 * 3, 1.0);
        let got = delta(
            &[
                ("lora_unet_x.lokr_w1", vec![1, 2], w1.clone()),
                ("lora_unet_x.lokr_w2", vec![2, 1, 3, 3], w2.clone()),
            ],
            &[],
            &[2, 2, 3, 3],
        );
        // kron(w1[..., None, None], w2): out = 0·2 + k, in = j·1 + 0.
        let mut want = vec![];
        for k in 0..2 {
            for w1j in &w1 {
                for s in 0..9 {
                    want.push(w1j * w2[k * 9 + s]);
                }
            }
        }
        close(&got, &want);
    }

    #[test]
    fn peft_b_times_a_with_metadata_alpha() {
        let got = delta(
            &[
                ("unet.x.lora_B.weight", vec![2, 1], vec![1., 2.]),
                ("unet.x.lora_A.weight", vec![1, 2], vec![3., 4.]),
            ],
            &[("lora_adapter_metadata", r#"{"unet.lora_alpha": 4, "unet.r": 1}"#)],
            &[2, 2],
        );
        close(&got, &[12., 16., 24., 32.]);
    }

    #[test]
    fn inpainting_conv_in_gets_zero_padded() {
        let got = delta(
            &[
                ("lora_unet_conv_in.lora_up.weight", vec![2, 1, 1, 1], vec![1., 2.]),
                ("lora_unet_conv_in.lora_down.weight", vec![1, 4, 1, 1], vec![1., 2., 3., 4.]),
            ],
            &[],
            &[2, 9, 1, 1],
        );
        close(&got, &[1., 2., 3., 4., 0., 0., 0., 0., 0., 2., 4., 6., 8., 0., 0., 0., 0., 0.]);
    }

    #[test]
    fn delta_for_a_wrong_shape_is_refused() {
        let (_dir, file) = read(
            &[
                ("lora_unet_x.lora_up.weight", vec![2, 1], vec![1., 2.]),
                ("lora_unet_x.lora_down.weight", vec![1, 2], vec![3., 4.]),
            ],
            &[],
        );
        let patch = Patch { network: Network::Unet, target: "x.weight".into(), module: 0, rows: Rows::All };
        let err = file.delta(&patch, &[3, 3], &Device::Cpu).unwrap_err();
        assert!(
            matches!(&err, LoraError::Shape { expected, got, .. } if expected == &[3, 3] && got == &[2, 2]),
            "{err}"
        );
    }
}
