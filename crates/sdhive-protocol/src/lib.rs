//! The JSON that crosses process boundaries: the native job API (`/v1/jobs`), its server-sent events, the
//! error body every route family shares, the model lists' entries, and the worker ⇄ hive registration and
//! heartbeat messages; and the `Authorization` header both accept (`auth`). Only
//! serde types and that header check live here so that the worker and the hive (and external clients) agree on
//! one definition; behaviour stays in `sdhive-server`. See `docs/api.md` and `docs/protocol.md`.

pub mod auth;
pub mod error;
pub mod guidance;
pub mod hires;
pub mod job;
pub mod models;
pub mod networks;
pub mod registration;

pub use auth::{parse_api_auth, BasicUsers, Credentials};
pub use error::{ErrorBody, ErrorDetail};
pub use guidance::SkipLayerGuidanceRequest;
pub use hires::HiresRequest;
pub use job::{
    JobAccepted, JobError, JobErrorKind, JobEvent, JobId, JobImage, JobLinks, JobRequest, JobSnapshot,
    JobState, RequestSummary, Seed,
};
pub use models::{file_stem, is_openai_model_name, ListedModel, OPENAI_MODEL_NAMES};
pub use networks::{union_loras, EmbeddingList, ListedEmbedding, ListedLora, LoraRequest};
pub use registration::{
    Capabilities, Deregister, DeviceDescription, Heartbeat, HeartbeatResponse, LibraryModel, NodeSummary,
    RegisterRequest, RegisterResponse, RunningJob, WorkerState, DEFAULT_HEARTBEAT_INTERVAL_SECS,
    PROTOCOL_VERSION,
};
