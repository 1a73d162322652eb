//! Each kernel against the plain candle ops it replaces, on GPU 0, in every dtype it takes. These run on a
//! machine with a CUDA GPU (the test binary built by `cargo xtask build-cuda --tests`).

use super::*;
use candle_core::{DType, Device, D};

fn gpu() -> Device {
    Device::new_cuda(0).expect("the sdhive-cuda-kernels tests need a CUDA GPU")
}

/// Max |a − b| relative to b's largest magnitude (at least 1), in f32, on the host: a NaN anywhere gives NaN
/// (a GPU max reduction may skip it), which every `d <= tol` check then rejects.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let host = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (host(a), host(b));
    assert_eq!(a.len(), b.len());
    let mut diff = 0f32;
    for (x, y) in a.iter().zip(&b) {
        let d = (x - y).abs();
        if d.is_nan() && !(x.is_infinite() && x == y) {
            return f32::NAN;
        }
        diff = diff.max(if x == y { 0.0 } else { d });
    }
    diff / b.iter().fold(1f32, |m, v| m.max(v.abs()))
}

/// Each dtype's tolerance: its rounding of the output.
fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn group_norm_reference(x: &Tensor, w: &Tensor, b: &Tensor, groups: usize, eps: f64, silu: bool) -> Tensor {
    let dims = x.dims().to_vec();
    let xf = x.to_dtype(DType::F64).unwrap().reshape((dims[0], groups, ())).unwrap();
    let mean = xf.mean_keepdim(2).unwrap();
    let c = xf.broadcast_sub(&mean).unwrap();
    let var = c.sqr().unwrap().mean_keepdim(2).unwrap();
    let mut shape = vec![1usize; dims.len()];
    shape[1] = dims[1];
    let wf = w.to_dtype(DType::F64).unwrap().reshape(shape.clone()).unwrap();
    let bf = b.to_dtype(DType::F64).unwrap().reshape(shape).unwrap();
    let y = c
        .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
        .unwrap()
        .reshape(dims)
        .unwrap()
        .broadcast_mul(&wf)
        .unwrap()
        .broadcast_add(&bf)
        .unwrap();
    if silu {
        y.silu().unwrap()
    } else {
        y
    }
}

#[test]
fn group_norm_matches_the_reference() {
    let dev = gpu();
    // Odd spatial sizes, one chunk and many chunks per group, and a large offset that E[x²] − E[x]² would lose.
    for (shape, groups, offset) in
        [((2, 64, 9, 7), 32, 0.0), ((1, 32, 96, 96), 8, 0.0), ((2, 16, 40, 40), 4, 300.0)]
    {
        let x = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() + offset).unwrap();
        let w = Tensor::randn(1f32, 0.2, shape.1, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, shape.1, &dev).unwrap();
        for dtype in DTYPES {
            let (xd, wd, bd) =
                (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
            assert!(applies(&[&xd, &wd, &bd]));
            for silu in [false, true] {
                let ours = group_norm(&xd, &wd, &bd, groups, 1e-5, silu).unwrap();
                assert_eq!(ours.dtype(), dtype);
                let want = group_norm_reference(&xd, &wd, &bd, groups, 1e-5, silu);
                let d = rel_diff(&ours, &want);
                eprintln!("group_norm {shape:?}/{groups} +{offset} {dtype:?} silu={silu}: rel diff {d:.2e}");
                assert!(d <= tol(dtype), "group_norm {shape:?} {dtype:?} silu={silu}: {d}");
            }
        }
    }
}

#[test]
fn channel_adds_match_broadcast_adds() {
    let dev = gpu();
    let y = Tensor::randn(0f32, 1.0, (2, 6, 5, 3), &dev).unwrap();
    let bias = Tensor::randn(0f32, 1.0, (1, 6), &dev).unwrap();
    let per_sample = Tensor::randn(0f32, 1.0, (2, 6), &dev).unwrap();
    let residual = Tensor::randn(0f32, 1.0, (2, 6, 5, 3), &dev).unwrap();
    let tokens = Tensor::randn(0f32, 1.0, (4, 7, 10), &dev).unwrap();
    let last_bias = Tensor::randn(0f32, 1.0, 10, &dev).unwrap();
    let token_res = Tensor::randn(0f32, 1.0, (4, 7, 10), &dev).unwrap();
    for dtype in DTYPES {
        let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
        let (y, r) = (c(&y), c(&residual));
        for add in [c(&bias), c(&per_sample)] {
            let want = y.broadcast_add(&add.reshape((add.dim(0).unwrap(), 6, 1, 1)).unwrap()).unwrap();
            let d = rel_diff(&add_channel(&y, &add, None).unwrap(), &want);
            assert!(d <= tol(dtype), "add_channel {:?} {dtype:?}: {d}", add.dims());
            let d = rel_diff(&add_channel(&y, &add, Some(&r)).unwrap(), &(&want + &r).unwrap());
            assert!(d <= 2.0 * tol(dtype), "add_channel + residual {:?} {dtype:?}: {d}", add.dims());
        }
        let (t, tb, tr) = (c(&tokens), c(&last_bias), c(&token_res));
        let want = t.broadcast_add(&tb).unwrap();
        assert!(rel_diff(&add_bias_last(&t, &tb, None).unwrap(), &want) <= tol(dtype));
        let d = rel_diff(&add_bias_last(&t, &tb, Some(&tr)).unwrap(), &(&want + &tr).unwrap());
        assert!(d <= 2.0 * tol(dtype), "add_bias_last + residual {dtype:?}: {d}");
    }
    // A per-sample term whose batch does not match is refused, not read out of bounds.
    let wrong = Tensor::zeros((3, 6), DType::F32, &dev).unwrap();
    assert!(add_channel(&y, &wrong, None).is_err());
}

/// Softmax over the last dimension with candle's ops, in f32.
fn softmax_reference(x: &Tensor) -> Tensor {
    let xf = x.to_dtype(DType::F32).unwrap();
    let e = xf.broadcast_sub(&xf.max_keepdim(D::Minus1).unwrap()).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

#[test]
fn softmax_matches_the_reference() {
    let dev = gpu();
    let shapes: [(&[usize], f64); 3] = [(&[3, 5, 4096], 4.0), (&[7, 77], 30.0), (&[2, 3, 33], 1.0)];
    for (shape, scale) in shapes {
        let x = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() * scale).unwrap();
        for dtype in DTYPES {
            let xd = x.to_dtype(dtype).unwrap();
            let want = softmax_reference(&xd);
            let ours = softmax_last_dim(&xd).unwrap();
            let sums = ours.to_dtype(DType::F32).unwrap().sum(D::Minus1).unwrap();
            let d = rel_diff(&ours, &want);
            eprintln!("softmax {shape:?} ×{scale} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= tol(dtype), "softmax {shape:?} {dtype:?}: {d}");
            assert!(rel_diff(&sums, &sums.ones_like().unwrap()) <= 50.0 * tol(dtype));
        }
    }
}

/// A causal mask's −∞ scores (CLIP's attention) give zero weight, also at the start of a row.
#[test]
fn softmax_of_masked_rows() {
    let dev = gpu();
    // 77 columns take the element-wise path, 128 the 16-byte one.
    for n in [77usize, 128] {
        let mask: Vec<f32> =
            (0..n * n).map(|i| if i % n > i / n { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (n, n), &dev).unwrap();
        let x = Tensor::randn(0f32, 3.0, (4, n, n), &dev).unwrap().broadcast_add(&mask).unwrap();
        // Rows whose first values are masked, as in a row-reversed causal mask.
        let flipped = x.flip(&[2]).unwrap().contiguous().unwrap();
        for scores in [x, flipped] {
            for dtype in DTYPES {
                let xd = scores.to_dtype(dtype).unwrap();
                let want = softmax_reference(&xd);
                let ours = softmax_last_dim(&xd).unwrap();
                let d = rel_diff(&ours, &want);
                assert!(d.is_finite() && d <= tol(dtype), "masked softmax {n} {dtype:?}: {d}");
            }
        }
    }
}

#[test]
fn geglu_matches_the_reference() {
    let dev = gpu();
    let x = Tensor::randn(0f32, 2.0, (2, 5, 96), &dev).unwrap();
    for dtype in DTYPES {
        let xd = x.to_dtype(dtype).unwrap();
        let hidden = xd.narrow(D::Minus1, 0, 48).unwrap().to_dtype(DType::F32).unwrap();
        let gate = xd.narrow(D::Minus1, 48, 48).unwrap().to_dtype(DType::F32).unwrap();
        let want = hidden.mul(&gate.gelu_erf().unwrap()).unwrap();
        let ours = geglu(&xd).unwrap();
        assert_eq!(ours.dims(), &[2, 5, 48]);
        let d = rel_diff(&ours, &want);
        assert!(d <= tol(dtype), "geglu {dtype:?}: {d}");
    }
}

#[test]
fn other_devices_and_layouts_do_not_apply() {
    let cpu = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(!applies(&[&cpu]));
    let g = Tensor::zeros((4, 6), DType::F32, &gpu()).unwrap();
    assert!(applies(&[&g]));
    assert!(!applies(&[&g.t().unwrap()]), "a transposed view is not contiguous");
    assert!(!applies(&[&g.to_dtype(DType::F64).unwrap()]));
}

#[test]
fn layer_norm_matches_the_reference() {
    let dev = gpu();
    for (shape, offset) in
        [((2, 77, 768), 0.0), ((3, 4096, 320), 0.0), ((1, 5, 1280), 200.0), ((2, 3, 33), 1.0)]
    {
        let x = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() + offset).unwrap();
        let cols = x.dims()[x.rank() - 1];
        let w = Tensor::randn(1f32, 0.2, cols, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, cols, &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let xf = c(&x).to_dtype(DType::F64).unwrap();
            let mean = xf.mean_keepdim(D::Minus1).unwrap();
            let centered = xf.broadcast_sub(&mean).unwrap();
            let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let want = centered
                .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(&c(&w).to_dtype(DType::F64).unwrap())
                .unwrap()
                .broadcast_add(&c(&b).to_dtype(DType::F64).unwrap())
                .unwrap();
            let d = rel_diff(&layer_norm(&c(&x), &c(&w), &c(&b), 1e-5).unwrap(), &want);
            eprintln!("layer_norm {shape:?} +{offset} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= tol(dtype), "layer_norm {shape:?} {dtype:?}: {d}");
        }
    }
}

/// Every convolution shape of the networks: 3×3 padded, strided downsampling, 1×1, odd sizes.
#[test]
fn conv2d_matches_candle() {
    let dev = gpu();
    for (x_shape, w_shape, stride, pad) in [
        ((2, 8, 17, 13), (16, 8, 3, 3), 1, 1),
        ((1, 6, 16, 16), (6, 6, 3, 3), 2, 1),
        ((2, 12, 9, 7), (5, 12, 1, 1), 1, 0),
        ((1, 4, 8, 8), (3, 4, 3, 3), 1, 0),
    ] {
        let x = Tensor::randn(0f32, 1.0, x_shape, &dev).unwrap();
        let w = Tensor::randn(0f32, 0.2, w_shape, &dev).unwrap();
        for dtype in DTYPES {
            let (xd, wd) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
            let want = xd
                .to_dtype(DType::F32)
                .unwrap()
                .conv2d(&wd.to_dtype(DType::F32).unwrap(), pad, stride, 1, 1)
                .unwrap();
            let ours = conv2d(&xd, &wd, stride, pad).unwrap();
            assert_eq!(ours.dims(), want.dims());
            let d = rel_diff(&ours, &want);
            eprintln!("conv2d {x_shape:?} * {w_shape:?} s{stride} p{pad} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= 4.0 * tol(dtype), "conv2d {x_shape:?} {dtype:?}: {d}");
        }
    }
}
