//! The native job API's wire types: the submitted request, the job snapshot a poll returns, the SSE events,
//! and the identifiers and states they share.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// An opaque job identifier. The server mints them (`job_` + 24 hex digits); clients must not parse them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub String);

impl JobId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for JobId {
    fn from(s: String) -> Self {
        JobId(s)
    }
}

impl From<&str> for JobId {
    fn from(s: &str) -> Self {
        JobId(s.to_string())
    }
}

/// A job's life: `queued` → `running` → one of the three terminal states (a queued job can also go straight to
/// `cancelled`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 5] =
        [JobState::Queued, JobState::Running, JobState::Succeeded, JobState::Failed, JobState::Cancelled];

    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A seed as clients send it: a non-negative integer, or `-1` (A1111's "random"). Absent also means random.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seed {
    Fixed(u64),
    Random,
}

impl Seed {
    pub fn fixed(self) -> Option<u64> {
        match self {
            Seed::Fixed(s) => Some(s),
            Seed::Random => None,
        }
    }
}

impl Serialize for Seed {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Seed::Fixed(v) => s.serialize_u64(*v),
            Seed::Random => s.serialize_i64(-1),
        }
    }
}

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct SeedVisitor;
        impl Visitor<'_> for SeedVisitor {
            type Value = Seed;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a non-negative integer, or -1 for a random seed")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed::Fixed(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                match v {
                    -1 => Ok(Seed::Random),
                    v if v >= 0 => Ok(Seed::Fixed(v as u64)),
                    _ => Err(E::invalid_value(de::Unexpected::Signed(v), &self)),
                }
            }
            // JSON clients written in languages without integers send 42.0; accept it when it is one.
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Seed, E> {
                if v == -1.0 {
                    Ok(Seed::Random)
                } else if v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v) {
                    Ok(Seed::Fixed(v as u64))
                } else {
                    Err(E::invalid_value(de::Unexpected::Float(v), &self))
                }
            }
        }
        d.deserialize_any(SeedVisitor)
    }
}

/// `POST /v1/jobs`. Every field but `prompt` is optional; unknown fields are refused so a typo (`step`) is an
/// error naming it rather than a silently ignored setting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobRequest {
    pub prompt: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cfg_scale: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<Seed>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// A1111 sampler name or alias (`Euler a`, `DPM++ 2M Karras`, `k_euler`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampler: Option<String>,
    /// `Automatic` or `Karras`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_skip: Option<u32>,
    /// Base64 PNG/JPEG/WebP, optionally as a `data:` URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strength: Option<f32>,
    /// Base64 image, white = repaint; needs `init_image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask: Option<String>,
    /// A `preview` event every k-th step; accepted and ignored where the worker makes no previews
    /// (`capabilities.preview` false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview_every: Option<u32>,
    /// The checkpoint, by any name A1111 accepts (title, name, file name, hash); default: the selected one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A1111's `sd_vae` values: `Automatic`, `None` or a VAE file name; default: the selected choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vae: Option<String>,
    /// LoRAs to apply besides the prompt's `<lora:…>` tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loras: Option<Vec<crate::networks::LoraRequest>>,
    /// A1111's hires fix: a second, img2img pass at a larger size (txt2img only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hires: Option<crate::hires::HiresRequest>,
    /// A1111 prompt styles (`--styles-file`) applied to the prompt and negative prompt, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub styles: Option<Vec<String>>,
    /// The images' file format: `png` (default), `jpeg` (or `jpg`) or `webp` (lossless). The generation
    /// parameters go where A1111 keeps them: a PNG `parameters` chunk, the EXIF `UserComment` of the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_format: Option<String>,
    /// JPEG quality, 0–100 (default 90).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_quality: Option<u32>,
    /// Skip-layer guidance (SD3-family models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_layer_guidance: Option<crate::guidance::SkipLayerGuidanceRequest>,
}

/// `202 Accepted` answer to a submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobAccepted {
    pub id: JobId,
    pub state: JobState,
    pub queue_position: Option<usize>,
    pub links: JobLinks,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobLinks {
    #[serde(rename = "self")]
    pub self_: String,
    pub events: String,
    pub cancel: String,
}

impl JobLinks {
    /// Server-relative links for `id`.
    pub fn for_job(id: &JobId) -> JobLinks {
        JobLinks {
            self_: format!("/v1/jobs/{id}"),
            events: format!("/v1/jobs/{id}/events"),
            cancel: format!("/v1/jobs/{id}/cancel"),
        }
    }
}

/// What the job was asked to do, with defaults and the drawn seed filled in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestSummary {
    pub prompt: String,
    pub negative_prompt: String,
    pub steps: u32,
    pub cfg_scale: f32,
    pub width: u32,
    pub height: u32,
    /// Seed of the first image; image `i` uses `seed + i`.
    pub seed: u64,
    pub n: u32,
    pub sampler: String,
    pub scheduler: String,
    pub clip_skip: u32,
    /// Set for img2img and inpainting.
    pub strength: Option<f32>,
    pub img2img: bool,
    pub inpaint: bool,
    /// The checkpoint's title (A1111's), when the worker knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobImage {
    pub index: u32,
    pub seed: u64,
    pub width: u32,
    pub height: u32,
    /// A1111 parameters text, also embedded in the image (a PNG's `parameters` chunk, a JPEG's or WebP's EXIF
    /// `UserComment`).
    pub infotext: String,
    /// `png`, `jpeg` or `webp`: the request's `output_format`.
    #[serde(default = "png")]
    pub format: String,
    /// The encoded image, base64.
    #[serde(default)]
    pub image_base64: String,
    /// The same bytes as `image_base64` when `format` is `png`, for clients written before `output_format`;
    /// absent (empty) otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub png_base64: String,
}

fn png() -> String {
    "png".into()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobErrorKind {
    /// The engine refused the request for this model (e.g. a size the VAE cannot divide).
    InvalidRequest,
    OutOfMemory,
    /// The engine returned an error.
    EngineError,
    /// The engine panicked; the worker caught it and keeps serving.
    EnginePanic,
    /// The worker shut down before the job could run or finish; submitting it again elsewhere is the remedy.
    ShuttingDown,
    /// Set by the hive: the worker running the job died (or stopped answering) before it finished.
    WorkerLost,
}

impl JobErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            JobErrorKind::InvalidRequest => "invalid_request",
            JobErrorKind::OutOfMemory => "out_of_memory",
            JobErrorKind::EngineError => "engine_error",
            JobErrorKind::EnginePanic => "engine_panic",
            JobErrorKind::ShuttingDown => "shutting_down",
            JobErrorKind::WorkerLost => "worker_lost",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobError {
    pub kind: JobErrorKind,
    pub message: String,
    /// For `invalid_request`: the request field at fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
}

/// `GET /v1/jobs/{id}`. Timestamps are Unix seconds (fractional); durations are seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSnapshot {
    pub id: JobId,
    pub state: JobState,
    /// Jobs ahead of this one in the queue (0 = next to run); `null` unless queued.
    pub queue_position: Option<usize>,
    /// Finished steps of the current image (1-based once started).
    pub step: u32,
    /// Steps per image (fewer than `request.steps` for img2img, as the strength skips the noisiest ones).
    pub total_steps: u32,
    /// 0-based index of the image being made.
    pub image_index: u32,
    pub images_total: u32,
    pub eta_seconds: Option<f64>,
    pub created_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    /// Time spent queued (so far, while queued).
    pub queue_seconds: Option<f64>,
    /// Time spent running (so far, while running).
    pub run_seconds: Option<f64>,
    pub error: Option<JobError>,
    /// Present once the job succeeded.
    pub images: Vec<JobImage>,
    pub request: RequestSummary,
    pub links: JobLinks,
}

/// One server-sent event of `GET /v1/jobs/{id}/events`. The SSE `event:` field is the `event` tag below and
/// `data:` is this object as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum JobEvent {
    /// Sent on submission and whenever the job moves up the queue.
    Queued {
        id: JobId,
        position: usize,
    },
    Started {
        id: JobId,
        started_at: f64,
    },
    /// After every denoising step.
    Progress {
        id: JobId,
        step: u32,
        total_steps: u32,
        image: u32,
        images: u32,
        eta_seconds: Option<f64>,
    },
    /// Every `preview_every`-th step: the current estimate of the image as a base64 PNG, at 1/8 of the output
    /// size (latent previews) or at the output size (TAESD; `/v1/info` `preview` says which).
    Preview {
        id: JobId,
        step: u32,
        image: u32,
        png_base64: String,
    },
    Completed {
        id: JobId,
        images: Vec<JobImage>,
        run_seconds: f64,
    },
    Failed {
        id: JobId,
        error: JobError,
    },
    /// `step` is the last finished step of the image that was being made.
    Cancelled {
        id: JobId,
        step: u32,
    },
}

impl JobEvent {
    /// The SSE event name.
    pub fn name(&self) -> &'static str {
        match self {
            JobEvent::Queued { .. } => "queued",
            JobEvent::Started { .. } => "started",
            JobEvent::Progress { .. } => "progress",
            JobEvent::Preview { .. } => "preview",
            JobEvent::Completed { .. } => "completed",
            JobEvent::Failed { .. } => "failed",
            JobEvent::Cancelled { .. } => "cancelled",
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self, JobEvent::Completed { .. } | JobEvent::Failed { .. } | JobEvent::Cancelled { .. })
    }

    pub fn id(&self) -> &JobId {
        match self {
            JobEvent::Queued { id, .. }
            | JobEvent::Started { id, .. }
            | JobEvent::Progress { id, .. }
            | JobEvent::Preview { id, .. }
            | JobEvent::Completed { id, .. }
            | JobEvent::Failed { id, .. }
            | JobEvent::Cancelled { id, .. } => id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn seeds_accept_integers_and_minus_one() {
        let parse = |v: serde_json::Value| serde_json::from_value::<Seed>(v);
        assert_eq!(parse(json!(42)).unwrap(), Seed::Fixed(42));
        assert_eq!(parse(json!(-1)).unwrap(), Seed::Random);
        assert_eq!(parse(json!(7.0)).unwrap(), Seed::Fixed(7));
        assert_eq!(parse(json!(u64::MAX)).unwrap(), Seed::Fixed(u64::MAX));
        assert!(parse(json!(-2)).is_err());
        assert!(parse(json!(1.5)).is_err());
        assert!(parse(json!("42")).is_err());
        assert_eq!(serde_json::to_value(Seed::Random).unwrap(), json!(-1));
    }

    #[test]
    fn job_request_refuses_unknown_fields() {
        let err = serde_json::from_value::<JobRequest>(json!({"prompt": "a", "step": 3})).unwrap_err();
        assert!(err.to_string().contains("unknown field `step`"), "{err}");
        let ok: JobRequest = serde_json::from_value(json!({"prompt": "a", "seed": -1})).unwrap();
        assert_eq!(ok.seed, Some(Seed::Random));
    }

    #[test]
    fn events_are_tagged_by_name() {
        let e = JobEvent::Progress {
            id: "job_1".into(),
            step: 2,
            total_steps: 4,
            image: 0,
            images: 1,
            eta_seconds: Some(0.5),
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["event"], e.name());
        assert_eq!(v["id"], "job_1");
        assert_eq!(serde_json::from_value::<JobEvent>(v).unwrap(), e);
        assert_eq!(serde_json::to_value(JobState::Cancelled).unwrap(), json!("cancelled"));
        assert_eq!(serde_json::to_value(JobLinks::for_job(&"j".into())).unwrap()["self"], "/v1/jobs/j");
    }

    #[test]
    fn images_name_their_format_and_keep_png_base64_for_png() {
        let image = |format: &str, png: &str| JobImage {
            index: 0,
            seed: 1,
            width: 8,
            height: 8,
            infotext: "p".into(),
            format: format.into(),
            image_base64: "AAAA".into(),
            png_base64: png.into(),
        };
        let webp = serde_json::to_value(image("webp", "")).unwrap();
        assert_eq!((&webp["format"], &webp["image_base64"]), (&json!("webp"), &json!("AAAA")));
        assert!(webp.get("png_base64").is_none(), "{webp}");
        assert_eq!(serde_json::to_value(image("png", "AAAA")).unwrap()["png_base64"], "AAAA");
        // A snapshot from before `format` existed reads as a PNG.
        let old: JobImage = serde_json::from_value(
            json!({"index": 0, "seed": 1, "width": 8, "height": 8, "infotext": "p", "png_base64": "AAAA"}),
        )
        .unwrap();
        assert_eq!((old.format.as_str(), old.png_base64.as_str()), ("png", "AAAA"));
        let req: JobRequest =
            serde_json::from_value(json!({"prompt": "a", "output_format": "jpeg", "output_quality": 70}))
                .unwrap();
        assert_eq!((req.output_format.as_deref(), req.output_quality), (Some("jpeg"), Some(70)));
    }
}
