//! Fused CUDA kernels for the networks' hot operations: GroupNorm (+SiLU), LayerNorm, per-channel
//! bias / time-embedding / residual adds, row softmax, GEGLU, the im2col of the convolutions, and multi-head
//! attention that never materialises its scores; on Hopper the feed-forward's first product with GEGLU in its
//! epilogue and the transformers' narrow products with the LayerNorm after them; cuDNN convolutions, cuDNN's fused attention for heads
//! of 64, and cuBLASLt linears; the channels-last
//! (NHWC) variants of the map operations (the skip connections' channel concatenation among them, and a GroupNorm
//! of two maps joined along their channels that writes the join itself), the NCHW ↔ NHWC transpose at a network's
//! edges, and the 3×3 convolutions there that change layout in the same launch; for the upscalers' ESRGAN,
//! LeakyReLU alone or on the newer half of a channel join, and the residual `s·a + b`; and device-to-host copies
//! that the stream runs in its order while the host goes on ([`start_readback`]). Each kernel replaces a chain of
//! candle ops that made one pass over the tensor per op (several through candle's strided broadcast kernels).
//! [`applies`] says when a call can take the element-wise ones: every tensor contiguous on one CUDA device, in f32,
//! f16 or bf16; [`attention_applies`] the same for the attention. The callers (sdhive-models' and sdhive-upscale's
//! ops) keep candle's ops as the reference and for every other case; the tests here (sdhive-upscale's for the
//! upscalers' kernels) compare the two on a GPU.
//!
//! Without the `cuda` feature nothing applies and the functions return an error.

use candle_core::{Result, Tensor};

/// Whether the environment switch `$var` is on (anything but `0`, unset included), read once per process (defined
/// before the modules, which use it too).
#[cfg(feature = "cuda")]
macro_rules! switched_on {
    ($var:literal) => {{
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var($var).map_or(true, |v| v != "0"))
    }};
}

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cudnn")]
mod conv_splitk;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cudnn")]
mod cudnn;
#[cfg(feature = "cudnn")]
mod cudnn_attention;
#[cfg(feature = "cuda")]
mod edge_conv;
#[cfg(feature = "cuda")]
mod geglu;
#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod linear_norm;
#[cfg(feature = "cuda")]
mod readback;
#[cfg(feature = "cuda")]
mod scores;
#[cfg(feature = "cuda")]
mod upscale;

#[cfg(feature = "cuda")]
pub use graph::Graph;

/// A recorded CUDA launch sequence (see [`capture_graph`]); none exists in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub enum Graph {}

#[cfg(not(feature = "cuda"))]
impl Graph {
    pub fn replays_here(&self) -> bool {
        match *self {}
    }

    pub fn launch(&self) -> Result<()> {
        match *self {}
    }
}

/// How the activations of a [`linear`] product are laid out.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Side {
    /// `(B, S, features)`: one row per token.
    Tokens,
    /// `(B, features, S)`: one row per channel (NCHW with `S = H·W`).
    ChannelsFirst,
}

/// The body of a public wrapper: `$call` with the `cuda` feature; without it the arguments are unused and the
/// call fails naming the missing feature.
macro_rules! on_cuda {
    ($call:expr; $($arg:ident),+) => {{
        #[cfg(feature = "cuda")]
        return $call;
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ($($arg),+);
            Err(unavailable())
        }
    }};
}

/// Whether the kernels can take these tensors. `SDHIVE_FUSED_KERNELS=0` in the environment turns them off (to
/// measure what they buy; the results are the same within rounding).
pub fn applies(tensors: &[&Tensor]) -> bool {
    applies_any_layout(tensors) && tensors.iter().all(|t| t.is_contiguous())
}

/// [`applies`] for kernels that read strided operands and check their layouts themselves: one CUDA device, one
/// dtype of f32, f16 or bf16, the kernels switched on.
pub fn applies_any_layout(tensors: &[&Tensor]) -> bool {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        let Some(first) = tensors.first() else { return false };
        switched_on!("SDHIVE_FUSED_KERNELS")
            && first.device().is_cuda()
            && tensors.iter().all(|t| {
                t.device().same_device(first.device())
                    && t.dtype() == first.dtype()
                    && matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16)
            })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = tensors;
        false
    }
}

thread_local! {
    static TF32: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Restores the previous TF32 setting of this thread when dropped.
pub struct Tf32Guard(bool);

impl Drop for Tf32Guard {
    fn drop(&mut self) {
        TF32.with(|t| t.set(self.0));
    }
}

/// Lets f32 convolutions on this thread use TF32 tensor cores (with the `cudnn` feature) until the guard drops:
/// PyTorch's default for cuDNN convolutions, so what diffusers' f32-upcast SDXL VAE computes on a GPU. Elsewhere
/// f32 stays exact f32.
pub fn tf32_convolutions() -> Tf32Guard {
    Tf32Guard(TF32.with(|t| t.replace(true)))
}

/// Whether f32 convolutions on this thread may use TF32 now ([`tf32_convolutions`]): a recorded call must be
/// replayed only under the setting it was recorded with.
pub fn tf32_convolutions_on() -> bool {
    TF32.with(std::cell::Cell::get)
}

/// Whether [`attention`] takes these `(B, S, H·D)` projections: f16 or bf16 on one CUDA device, a build for
/// compute capability 8.0 or later, a head dimension that is a multiple of 8 up to 160, rows 16-byte aligned.
/// `SDHIVE_FUSED_ATTENTION=0` (or `SDHIVE_FUSED_KERNELS=0`) turns it off.
pub fn attention_applies(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        attention_enabled() && attention::unsupported(q, k, v, heads).is_none()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, k, v, heads);
        false
    }
}

/// Whether [`causal_attention`] takes these `(B, S, H·D)` projections: [`attention_applies`]'s conditions, as many
/// queries as keys, at most 128 of them, heads of 64 (the CLIP text encoders' self-attention).
pub fn causal_attention_applies(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        attention_enabled() && attention::unsupported_causal(q, k, v, heads).is_none()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, k, v, heads);
        false
    }
}

/// [`attention`] where query row r attends to keys 0..=r only. Call only where [`causal_attention_applies`].
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    on_cuda!(attention::causal_attention(q, k, v, heads, scale); q, k, v, heads, scale)
}

/// Whether attention on `device` in `dtype` runs fused (no score matrix), for memory estimates: the shape checks
/// of [`attention_applies`] hold for every head layout of the supported networks but the VAE's single wide head.
pub fn attention_fused_on(device: &candle_core::Device, dtype: candle_core::DType) -> bool {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        attention_enabled()
            && attention::built_for_sm80()
            && device.is_cuda()
            && matches!(dtype, DType::F16 | DType::BF16)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype);
        false
    }
}

#[cfg(feature = "cuda")]
fn attention_enabled() -> bool {
    switched_on!("SDHIVE_FUSED_KERNELS") && switched_on!("SDHIVE_FUSED_ATTENTION")
}

/// `softmax(q kᵀ · scale) v` per head on the projections' `(B, S, H·D)` layout (any batch and row strides),
/// returning `(B, Sq, H·D)` contiguous; scores and softmax in f32, probabilities rounded to the storage type
/// before the product with v. Call only where [`attention_applies`].
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    on_cuda!(attention::attention(q, k, v, heads, scale); q, k, v, heads, scale)
}

/// The name of the kernel [`attention`] launches for heads of `head_dim` in `dtype` on `device` (the Hopper kernel
/// or the mma.sync one) when key and value rows lie `key_stride` elements apart, so tests can see which one ran.
pub fn attention_kernel(
    device: &candle_core::Device,
    head_dim: usize,
    dtype: candle_core::DType,
    key_stride: usize,
) -> Result<String> {
    #[cfg(feature = "cuda")]
    {
        match device {
            candle_core::Device::Cuda(dev) => attention::kernel_for(dev, head_dim, dtype, key_stride),
            _ => candle_core::bail!("the fused attention runs on CUDA devices only"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, head_dim, dtype, key_stride);
        candle_core::bail!("built without the cuda feature")
    }
}

/// [`attention_kernel`] over `keys` keys: the short-key kernel (all keys in shared memory) takes up to 128 keys
/// at the head dimensions it is instantiated for (40, 64, 80, 160).
pub fn attention_kernel_for_keys(
    device: &candle_core::Device,
    head_dim: usize,
    keys: usize,
    dtype: candle_core::DType,
    key_stride: usize,
) -> Result<String> {
    #[cfg(feature = "cuda")]
    {
        match device {
            candle_core::Device::Cuda(dev) => {
                attention::kernel_for_keys(dev, head_dim, keys, dtype, key_stride)
            }
            _ => candle_core::bail!("the fused attention runs on CUDA devices only"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, head_dim, keys, dtype, key_stride);
        candle_core::bail!("built without the cuda feature")
    }
}

/// Whether calls on `device` may be recorded as CUDA graphs and replayed ([`capture_graph`]): a CUDA device.
/// `SDHIVE_CUDA_GRAPHS=0` turns it off (every call then launches its kernels one by one).
pub fn graphs_on(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        switched_on!("SDHIVE_CUDA_GRAPHS") && device.is_cuda()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// Records what `body` issues on `device` from this thread as a [`Graph`] instead of running it. Every tensor
/// `body` makes must be dropped inside it but the ones it returns; what it reads or writes from outside must
/// outlive the graph. A failed capture leaves the stream as it was.
pub fn capture_graph<T>(
    device: &candle_core::Device,
    body: impl FnOnce() -> Result<T>,
) -> Result<(Graph, T)> {
    on_cuda!(graph::capture(device, body); device, body)
}

/// Returns the memory that destroyed graphs reserved on `device` to the driver.
pub fn trim_graph_memory(device: &candle_core::Device) -> Result<()> {
    on_cuda!(graph::trim(device); device)
}

/// `(reserved, most reserved, used)` bytes of the graph memory on `device`: what recorded graphs keep between
/// replays.
pub fn graph_memory(device: &candle_core::Device) -> Result<(u64, u64, u64)> {
    on_cuda!(graph::memory(device); device)
}

/// `(reserved, used, most used)` bytes of `device`'s memory pool, then its unused reserve returned to the driver.
pub fn pool_usage_then_trim(device: &candle_core::Device) -> Result<(u64, u64, u64)> {
    on_cuda!(graph::pool_usage_then_trim(device); device)
}

/// A tensor's values on their way to the host ([`start_readback`]): the copy is queued on the tensor's CUDA stream
/// and runs in its order while the caller queues more work; [`Readback::values`] waits for it. A CPU tensor's
/// values are read at once.
pub struct Readback<T: HostValue> {
    inner: ReadbackInner<T>,
}

enum ReadbackInner<T: HostValue> {
    Ready(Vec<T>),
    #[cfg(feature = "cuda")]
    Queued(readback::Pending<T>),
}

/// The value types a [`Readback`] carries: `f32` and `u8`.
#[cfg(feature = "cuda")]
pub trait HostValue: readback::Pooled + candle_core::WithDType {}
/// The value types a [`Readback`] carries: `f32` and `u8`.
#[cfg(not(feature = "cuda"))]
pub trait HostValue: candle_core::WithDType {}
impl HostValue for f32 {}
impl HostValue for u8 {}

impl<T: HostValue> Readback<T> {
    /// Whether the copy may still be running (a CUDA tensor's); a CPU tensor's values are already here.
    pub fn is_queued(&self) -> bool {
        !matches!(self.inner, ReadbackInner::Ready(_))
    }

    /// The values, once the copy has landed.
    pub fn values(self) -> Result<Vec<T>> {
        match self.inner {
            ReadbackInner::Ready(v) => Ok(v),
            #[cfg(feature = "cuda")]
            ReadbackInner::Queued(host) => readback::finish(host),
        }
    }
}

/// A point in a device's work, to measure the device time between two ([`Mark::ms_since`]) without waiting for
/// it: an event recorded in a CUDA device's stream, the host's clock on a device whose work runs as it is issued.
pub struct Mark {
    inner: MarkInner,
}

enum MarkInner {
    Host(std::time::Instant),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda_backend::cudarc::driver::CudaEvent),
}

/// Marks the point `device`'s work has been issued up to.
pub fn mark(device: &candle_core::Device) -> Result<Mark> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        use candle_core::cuda_backend::WrapErr;
        let event = dev.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
        return Ok(Mark { inner: MarkInner::Cuda(event) });
    }
    let _ = device;
    Ok(Mark { inner: MarkInner::Host(std::time::Instant::now()) })
}

impl Mark {
    /// Whether the device has reached this mark (a host mark always has); never waits.
    pub fn passed(&self) -> bool {
        match &self.inner {
            MarkInner::Host(_) => true,
            #[cfg(feature = "cuda")]
            MarkInner::Cuda(e) => e.try_is_complete().unwrap_or(false),
        }
    }

    /// Milliseconds of the device's work from `earlier` to this mark, once the device has reached both; `None`
    /// while it has not (this never waits) or when the two marks are of different kinds.
    pub fn ms_since(&self, earlier: &Mark) -> Option<f64> {
        match (&self.inner, &earlier.inner) {
            (MarkInner::Host(now), MarkInner::Host(then)) => {
                Some(now.duration_since(*then).as_secs_f64() * 1e3)
            }
            #[cfg(feature = "cuda")]
            (MarkInner::Cuda(end), MarkInner::Cuda(start)) => {
                if self.passed() && earlier.passed() {
                    start.elapsed_ms(end).ok().map(f64::from)
                } else {
                    None
                }
            }
            #[cfg(feature = "cuda")]
            _ => None,
        }
    }
}

/// Starts reading `t`'s values (in row-major order) to the host; see [`Readback`].
pub fn start_readback<T: HostValue>(t: &Tensor) -> Result<Readback<T>> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        let t = t.contiguous()?;
        return Ok(Readback { inner: ReadbackInner::Queued(readback::start(&t)?) });
    }
    Ok(Readback { inner: ReadbackInner::Ready(t.flatten_all()?.to_vec1::<T>()?) })
}

#[cfg(not(feature = "cuda"))]
fn unavailable() -> candle_core::Error {
    candle_core::Error::Msg("sdhive-cuda-kernels was built without its cuda feature".into())
}

/// GroupNorm over `(B, C, …)` with per-channel affine, statistics in f32; `silu` applies SiLU to the result.
pub fn group_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    on_cuda!(cuda::group_norm(x, weight, bias, groups, eps, silu); x, weight, bias, groups, eps, silu)
}

/// `y + add[n, c] (+ residual)` for NCHW-like `y` `(N, C, …)`; `add` is `(1, C)` (a bias) or `(N, C)` (a
/// per-sample term such as the ResNet time embedding, already summed with the bias).
pub fn add_channel(y: &Tensor, add: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    on_cuda!(cuda::add_channel(y, add, residual, false); y, add, residual)
}

/// `y + bias (+ residual)` with `bias` `(C)` along the last dimension of `y` (a linear layer's epilogue), or with
/// a per-sample `(N, C)` term over channels-last `y` `(N, …, C)` (the ResNet time embedding).
pub fn add_bias_last(y: &Tensor, bias: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    on_cuda!(cuda::add_channel(y, bias, residual, true); y, bias, residual)
}

/// Whether networks built on `device` in `dtype` keep their feature maps channels-last (NHWC, filters KRSC): a
/// CUDA device, f16 or bf16, a build with cuDNN. cuDNN's tensor-core convolutions work in NHWC; fed NCHW they
/// transpose input, filter and output on every call. `SDHIVE_CHANNELS_LAST=0` (or `SDHIVE_CUDNN=0`,
/// `SDHIVE_FUSED_KERNELS=0`) keeps NCHW. Read once per process, so a network built channels-last stays so.
pub fn channels_last_on(device: &candle_core::Device, dtype: candle_core::DType) -> bool {
    #[cfg(feature = "cudnn")]
    {
        use candle_core::DType;
        switched_on!("SDHIVE_FUSED_KERNELS")
            && switched_on!("SDHIVE_CUDNN")
            && switched_on!("SDHIVE_CHANNELS_LAST")
            && device.is_cuda()
            && matches!(dtype, DType::F16 | DType::BF16)
    }
    #[cfg(not(feature = "cudnn"))]
    {
        let _ = (device, dtype);
        false
    }
}

/// Whether the channels-last kernels ([`group_norm_channels_last`], [`upsample2x_channels_last`]) take `x`
/// `(N, …, C)`: [`applies`], and `C` a whole number of 16-byte vectors, at most 4096 channels.
pub fn channels_last_fits(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        applies(&[x]) && cuda::channels_last_fits(x)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = x;
        false
    }
}

/// GroupNorm over channels-last `(N, …, C)` (groups are runs of consecutive channels), statistics in f32, of
/// `x + shift` when an `(N, C)` `shift` is given (added to every pixel of its sample; it is not
/// materialised); `silu` applies SiLU to the result. Call only where [`channels_last_fits`].
pub fn group_norm_channels_last(
    x: &Tensor,
    shift: Option<&Tensor>,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    on_cuda!(cuda::group_norm_last((x, None), shift, weight, bias, groups, eps, silu); x, shift, weight, bias, groups, eps, silu)
}

/// Whether [`group_norm_channels_last_joined`] takes `a` and `b`: both [`channels_last_fits`], contiguous, on one
/// CUDA device in one 16-bit type, their other dimensions equal. `SDHIVE_JOINED_NORM=0` turns it off (the join is
/// then written by a concatenation pass before the norm).
pub fn group_norm_joined_applies(a: &Tensor, b: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        switched_on!("SDHIVE_JOINED_NORM")
            && a.device().is_cuda()
            && matches!(a.dtype(), DType::F16 | DType::BF16)
            && cuda::joinable(a, b)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, b);
        false
    }
}

/// [`group_norm_channels_last`] of `a` and `b` joined along their channels (`torch.cat(dim=-1)`: the up path's
/// skip connection), read in place, so the join is never written before the norm reads it: returns the
/// normalised join and the join itself (for the products that read it whole), written by the same launch. Call
/// only where both [`channels_last_fits`].
pub fn group_norm_channels_last_joined(
    a: &Tensor,
    b: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        let both = cuda::group_norm_last((a, Some(b)), None, weight, bias, groups, eps, silu)?;
        Ok((both.get(0)?, both.get(1)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, b, weight, bias, groups, eps, silu);
        Err(unavailable())
    }
}

/// `(B, M, N)` → `(B, N, M)`, contiguous (NCHW ↔ channels-last as `(B, C, H·W)` ↔ `(B, H·W, C)`) through shared-memory
/// tiles, coalesced both ways. Call only where [`applies`].
pub fn transpose_last2(x: &Tensor) -> Result<Tensor> {
    on_cuda!(cuda::transpose_last2(x); x)
}

/// [`transpose_last2`] with the output's rows zero-padded to `width`: `(B, C, H·W)` NCHW → `(B, H·W, width)`
/// channels-last with `width - C` zero channels. Call only where [`applies`].
pub fn transpose_last2_padded(x: &Tensor, width: usize) -> Result<Tensor> {
    on_cuda!(cuda::transpose_last2_padded(x, width); x, width)
}

/// [`transpose_last2`] of the first `n` columns: channels-last `(B, H·W, C)` → NCHW `(B, n, H·W)`, its first `n`
/// channels. Call only where [`applies`].
pub fn transpose_last2_narrow(x: &Tensor, n: usize) -> Result<Tensor> {
    on_cuda!(cuda::transpose_last2_narrow(x, n); x, n)
}

/// Whether [`edge_conv_out`] takes these operands (see it). `SDHIVE_EDGE_CONV=0` (or `SDHIVE_FUSED_KERNELS=0`)
/// keeps the network's edges on a padded convolution and a transpose.
pub fn edge_conv_out_applies(x: &Tensor, weight: &Tensor, bias: &Tensor, k: usize) -> bool {
    #[cfg(feature = "cuda")]
    return switched_on!("SDHIVE_EDGE_CONV") && edge_conv::out_takes(x, weight, bias, k);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, weight, bias, k);
        false
    }
}

/// A channels-last network's last 3×3 convolution (stride 1, padding 1) in one launch: map `(N, H, W, C)`, filter
/// `(8, 3, 3, C)` with zero rows past `k`, bias `(8)`; returns NCHW `(N, k, H, W)`, so no transpose follows. Call
/// only where [`edge_conv_out_applies`].
pub fn edge_conv_out(x: &Tensor, weight: &Tensor, bias: &Tensor, k: usize) -> Result<Tensor> {
    on_cuda!(edge_conv::conv_out(x, weight, bias, k); x, weight, bias, k)
}

/// Whether [`edge_conv_in`] takes these operands (see it); the same switches as [`edge_conv_out_applies`].
pub fn edge_conv_in_applies(x: &Tensor, weight: &Tensor, bias: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    return switched_on!("SDHIVE_EDGE_CONV") && edge_conv::in_takes(x, weight, bias);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, weight, bias);
        false
    }
}

/// A channels-last network's first 3×3 convolution (stride 1, padding 1) in one launch: NCHW input `(N, 4, H, W)`,
/// channels-last filter `(K, 3, 3, CP)` (columns past 4 unused), bias `(K)`; returns channels-last `(N, H, W, K)`,
/// so no transpose precedes it. Call only where [`edge_conv_in_applies`].
pub fn edge_conv_in(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    on_cuda!(edge_conv::conv_in(x, weight, bias); x, weight, bias)
}

/// Nearest-neighbour ×2 upsampling of channels-last `(N, H, W, C)`. Call only where [`channels_last_fits`].
pub fn upsample2x_channels_last(x: &Tensor) -> Result<Tensor> {
    on_cuda!(cuda::upsample2x_last(x); x)
}

/// Channels-last `a` and `b` joined along their channels (`torch.cat(dim=-1)`), in one launch. Call only where
/// both [`channels_last_fits`]; other dimensions or dtypes that differ are refused.
pub fn concat_channels_last(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    on_cuda!(cuda::concat_last(a, b); a, b)
}

/// Whether [`leaky_relu`], [`cat_leaky_relu`] and [`scale_add`] take these tensors: [`applies`], and each starts on
/// a 16-byte boundary with rows (its last dimension) of whole 16-byte vectors, which every thread moves one of.
pub fn vector_rows_apply(tensors: &[&Tensor]) -> bool {
    applies(tensors)
        && tensors.iter().all(|t| {
            let size = t.dtype().size_in_bytes();
            (t.layout().start_offset() * size).is_multiple_of(16)
                && t.dims().last().is_some_and(|&c| (c * size).is_multiple_of(16))
        })
}

/// LeakyReLU(0.2) (PyTorch's `x > 0 ? x : 0.2·x`, halves computed in f32 and rounded once) in one pass. Call only
/// where [`vector_rows_apply`] takes `x`.
pub fn leaky_relu(x: &Tensor) -> Result<Tensor> {
    on_cuda!(upscale::leaky_relu(x); x)
}

/// Channels-last `a` and [`leaky_relu`]`(b)` joined along their channels in one pass (ESRGAN's dense blocks: the
/// activation is never stored on its own). Call only where [`vector_rows_apply`] takes both; other dimensions that
/// differ are refused.
pub fn cat_leaky_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    on_cuda!(upscale::cat_leaky_relu(a, b); a, b)
}

/// `s·a + b` in one pass (halves computed in f32 and rounded once), `a` and `b` of one shape (others are refused).
/// Call only where [`vector_rows_apply`] takes both.
pub fn scale_add(a: &Tensor, s: f64, b: &Tensor) -> Result<Tensor> {
    on_cuda!(upscale::scale_add(a, s, b); a, s, b)
}

/// `x`'s batch repeated whole to `batch` samples in one launch (`torch.cat([x] * (batch // len(x)))`); `batch`
/// a multiple of `x`'s. Call only where [`applies`] and [`repeat_fits`].
pub fn repeat_batch(x: &Tensor, batch: usize) -> Result<Tensor> {
    on_cuda!(cuda::repeat_batch(x, batch); x, batch)
}

/// Whether [`repeat_batch`] takes `x`: a CUDA tensor of whole 16-byte vectors from a 16-byte boundary.
pub fn repeat_fits(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        applies(&[x]) && cuda::repeat_fits(x)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = x;
        false
    }
}

/// A convolution without bias on channels-last maps through cuDNN: input `(N, H, W, C)`, filter `(K, R, S, C)`,
/// output `(N, Ho, Wo, K)`. Only with the `cudnn` feature (see [`channels_last_on`]).
pub fn conv2d_channels_last(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    #[cfg(feature = "cudnn")]
    return cudnn::conv2d_channels_last(x, weight, stride, padding);
    #[cfg(not(feature = "cudnn"))]
    {
        let _ = (x, weight, stride, padding);
        Err(candle_core::Error::Msg("sdhive-cuda-kernels was built without its cudnn feature".into()))
    }
}

/// [`conv2d_channels_last`] `+ bias (+ skip)`, added in cuDNN's epilogue (the output written once, no add pass):
/// `bias` `(K)`, `skip` the output's shape `(N, Ho, Wo, K)`. Only with the `cudnn` feature. On Hopper the 3×3
/// convolutions of 8×8 maps (SD1.5's lowest UNet level) run a split-K kernel of this crate instead
/// (`conv_splitk.cu`); `SDHIVE_CONV_SPLITK=0` keeps them on cuDNN.
pub fn conv2d_channels_last_epilogue(
    x: &Tensor,
    weight: &Tensor,
    stride: usize,
    padding: usize,
    bias: &Tensor,
    skip: Option<&Tensor>,
) -> Result<Tensor> {
    #[cfg(feature = "cudnn")]
    {
        if switched_on!("SDHIVE_CONV_SPLITK") && conv_splitk::takes(x, weight, stride, padding, bias, skip) {
            return conv_splitk::conv2d(x, weight, bias, skip);
        }
        cudnn::conv2d_channels_last_epilogue(x, weight, stride, padding, bias, skip)
    }
    #[cfg(not(feature = "cudnn"))]
    {
        let _ = (x, weight, stride, padding, bias, skip);
        Err(candle_core::Error::Msg("sdhive-cuda-kernels was built without its cudnn feature".into()))
    }
}

/// `x·Wᵀ (+ bias) (+ residual)` as one cuBLASLt product, bias and residual in its epilogue; `x` tokens
/// `(B, S, K)` / `(S, K)` or channels-first `(B, K, S)`, the output tokens or channels-first (not both
/// channels-first: that is a 1×1 convolution). Every tensor contiguous, except that a `(B, S, K)` token input
/// into tokens may be a stretch of each sample's longer sequence (rows contiguous, samples further apart);
/// `SDHIVE_FUSED_LINEAR=0` turns it off (see [`linear_applies`]).
pub fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    input: Side,
    output: Side,
) -> Result<Tensor> {
    on_cuda!(gemm::linear(x, weight, bias, residual, input, output); x, weight, bias, residual, input, output)
}

/// `gelu_tanh(x·Wᵀ + bias)` over tokens `(B, S, K)` / `(S, K)` as one cuBLASLt product, the GELU in its epilogue.
/// Every tensor contiguous; where [`linear_applies`].
pub fn linear_gelu(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    on_cuda!(gemm::linear_gelu(x, weight, bias); x, weight, bias)
}

/// Whether [`linear`] takes these tensors: [`applies`], and `SDHIVE_FUSED_LINEAR` not `0`.
pub fn linear_applies(tensors: &[&Tensor]) -> bool {
    #[cfg(feature = "cuda")]
    {
        applies(tensors) && switched_on!("SDHIVE_FUSED_LINEAR")
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = tensors;
        false
    }
}

/// `scale · q kᵀ` in f32 for f16/bf16 queries `(N, Sq, D)` and keys `(N, Sk, D)`, both contiguous, as one
/// tensor-core product: the scores an upcast softmax wants, without converting q and k to f32 first.
pub fn attention_scores(q: &Tensor, k: &Tensor, scale: f64) -> Result<Tensor> {
    on_cuda!(scores::attention_scores(q, k, scale); q, k, scale)
}

/// Softmax over the last dimension, accumulated in f32.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    on_cuda!(cuda::softmax_last_dim(x); x)
}

/// LayerNorm over the last dimension with per-element affine, statistics in f32.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    on_cuda!(cuda::layer_norm(x, weight, bias, eps); x, weight, bias, eps)
}

/// An adaptive norm's `layer_norm(x) · (1 + scale) + shift` for `(B, S, D)` `x` and `(B, D)` rows of `shift` and
/// `scale` (each row contiguous; they may be chunks of a wider modulation table, read in place), in one pass.
pub fn modulated_layer_norm(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    on_cuda!(cuda::modulated_layer_norm(x, shift, scale, eps); x, shift, scale, eps)
}

/// RMSNorm of every `weight`-wide row of `x` (attention heads), statistics in f32, rounded as diffusers' RMSNorm
/// rounds in half precision (normalised, cast, then times the weight).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    on_cuda!(cuda::rms_norm(x, weight, eps); x, weight, eps)
}

/// Whether [`rms_norm`] takes `x` as laid out (with [`applies_any_layout`]): contiguous, or `(B, S, C)` rows
/// evenly spaced and 16-byte aligned (a column range of a stacked q/k/v projection) with heads the joint-rows
/// kernel takes.
pub fn rms_norm_takes(x: &Tensor, weight: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        x.is_contiguous() || cuda::rms_norm_in_place(x, weight)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, weight);
        false
    }
}

/// An MMDiT's joint query, key or value `(B, Sa + Sb, C)`: per sample the rows of `a` `(B, Sa, C)` then those of
/// `b` `(B, Sb, C)`, with `norms` each `d`-wide head RMS-normalised (as [`rms_norm`]) by `norms.0` in `a`'s rows
/// and `norms.1` in `b`'s, in one pass. `Ok(None)` where the kernel does not take the tensors.
pub fn joint_rows(
    a: &Tensor,
    b: &Tensor,
    norms: Option<(&Tensor, &Tensor)>,
    d: usize,
    eps: f64,
) -> Result<Option<Tensor>> {
    on_cuda!(cuda::joint_rows(a, b, norms, d, eps); a, b, norms, d, eps)
}

/// `x + gate · y` for `(B, S, D)` `x`, `y` and a `(B, D)` gate, in one pass. The gate's rows may lie apart (a
/// chunk of an adaptive norm's modulation, read in place).
pub fn gated_add(x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    on_cuda!(cuda::gated_add(x, gate, y); x, gate, y)
}

/// A 2-D convolution without bias (groups and dilation 1), NCHW: im2col in a coalesced layout, then one batched
/// matrix product that lands in NCHW (1×1 stride-1 convolutions skip the im2col).
///
/// With the `cudnn` feature, convolutions other than 1×1 go to cuDNN instead (`SDHIVE_CUDNN=0` keeps them on
/// im2col).
pub fn conv2d(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    #[cfg(feature = "cudnn")]
    {
        let pointwise = weight.dims().get(2..) == Some(&[1, 1][..]) && stride == 1 && padding == 0;
        if !pointwise && cudnn::applies(x) && switched_on!("SDHIVE_CUDNN") {
            return cudnn::conv2d(x, weight, stride, padding);
        }
    }
    on_cuda!(cuda::conv2d(x, weight, stride, padding); x, weight, stride, padding)
}

/// diffusers' GEGLU: the last dimension's first half times the exact (erf) GELU of its second half.
pub fn geglu(x: &Tensor) -> Result<Tensor> {
    geglu_bias(x, None)
}

/// [`geglu`] of `x + bias` (the projection's bias along the last dimension), in the same single pass.
pub fn geglu_bias(x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    on_cuda!(cuda::geglu(x, bias); x, bias)
}

/// Whether [`linear_geglu_interleaved`] takes a feed-forward of `k` input features and `h` GEGLU outputs in
/// `dtype` on `device`: a compute capability 9.0 GPU with the build's sm_90a PTX (`CUDA_COMPUTE_CAP=90`), f16 or
/// bf16, `k` a multiple of 64 and `h` of 64 (the interleave block). `SDHIVE_FUSED_GEGLU=0` (or
/// `SDHIVE_FUSED_KERNELS=0`) turns it off. A network decides once, at load, since the weights are stored for it.
pub fn geglu_product_on(device: &candle_core::Device, dtype: candle_core::DType, k: usize, h: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        switched_on!("SDHIVE_FUSED_KERNELS")
            && switched_on!("SDHIVE_FUSED_GEGLU")
            && geglu::product_on(device, dtype, k, h)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype, k, h);
        false
    }
}

/// A feed-forward's first linear, W1 `(2H, K)` and b1 `(2H)` (the GEGLU's first half then its gate), with their
/// rows interleaved as [`linear_geglu_interleaved`] reads them; done once, at load.
pub fn interleave_geglu(w1: &Tensor, b1: &Tensor) -> Result<(Tensor, Tensor)> {
    on_cuda!(geglu::interleave(w1, b1); w1, b1)
}

/// `geglu(x·W1ᵀ + b1)` in one kernel, the product never written: `x` `(…, K)` contiguous, the weight and bias
/// from [`interleave_geglu`], the output `(…, H)`; f32 accumulation, the erf GELU (exact, or above 256 rows
/// within 1.5e-7 of erf, as close as CUDA's own `erff`). Call only where [`geglu_product_on`]; other devices,
/// dtypes and shapes are refused.
pub fn linear_geglu_interleaved(x: &Tensor, w_il: &Tensor, b_il: &Tensor) -> Result<Tensor> {
    on_cuda!(geglu::product(x, w_il, b_il); x, w_il, b_il)
}

/// Whether [`linear_norm`] takes a product of `k` input features into `n` outputs in `dtype` on `device`: a compute
/// capability 9.0 GPU with the build's sm_90a PTX (`CUDA_COMPUTE_CAP=90`), f16 or bf16, `k` a multiple of 64 and
/// `n` one the kernel is instantiated for (320); the same for [`linear_rows`]. `SDHIVE_FUSED_LINEAR_NORM=0` (or
/// `SDHIVE_FUSED_KERNELS=0`) turns both off.
pub fn linear_norm_on(device: &candle_core::Device, dtype: candle_core::DType, k: usize, n: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        switched_on!("SDHIVE_FUSED_KERNELS")
            && switched_on!("SDHIVE_FUSED_LINEAR_NORM")
            && linear_norm::product_on(device, dtype, k, n)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype, k, n);
        false
    }
}

/// `h = x·Wᵀ + bias (+ residual)` and `LayerNorm(h)·gamma + beta` (over the last dimension, `eps` inside the root)
/// from one kernel: `x` `(…, K)`, `weight` `(N, K)`, the residual `(…, N)`; both results `(…, N)`, the LayerNorm
/// computed in f32 from h as stored. Call only where [`linear_norm_on`]; other devices, dtypes and shapes are
/// refused.
#[allow(clippy::too_many_arguments)]
pub fn linear_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    on_cuda!(linear_norm::product(x, weight, bias, residual, Some((gamma, beta, eps))); x, weight, bias, residual, gamma, beta, eps)
}

/// `x·Wᵀ + bias (+ residual)` from [`linear_norm`]'s kernel without the LayerNorm: for the products with a
/// residual that no norm follows, where cuBLASLt's residual epilogue is slow. The same shapes as [`linear_norm`]
/// (ask [`linear_norm_on`]); other devices, dtypes and shapes are refused.
pub fn linear_rows(x: &Tensor, weight: &Tensor, bias: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    on_cuda!(linear_norm::product(x, weight, bias, residual, None).map(|(h, _)| h); x, weight, bias, residual)
}

#[cfg(all(test, feature = "cuda"))]
mod tests;
