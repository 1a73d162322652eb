//! LoRAs and embeddings through every route family, over loopback HTTP with a recording stand-in engine: what
//! the engine receives in `req.loras` / `req.embeddings` (paths, multipliers, A1111 short hashes computed
//! independently here), the infotext's `Lora hashes` / `TI hashes`, the A1111 listings, 400s naming the field and
//! the LoRA, and an engine's refusal (a LoRA of the wrong family) as a 400 that leaves the queue working.

use sdhive_catalog::NetworksConfig;
use sdhive_engine::{
    infotext, Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, GeneratedImage,
    InfotextContext, Progress, RgbImage, ValidationError,
};
use sdhive_server::{AppState, ServerConfig};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Records every request and answers with a grey image carrying the real infotext. A LoRA named `xl_only` is
/// refused as the candle engine refuses a LoRA whose shapes do not fit the model.
struct Recorder {
    seen: Arc<Mutex<Vec<GenerateRequest>>>,
}

impl Engine for Recorder {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            engine: "recorder".into(),
            model: "rec".into(),
            family: "sd1".into(),
            native_width: 8,
            native_height: 8,
            samplers: vec!["Euler a".into(), "Euler".into()],
            ..EngineInfo::default()
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        self.seen.lock().unwrap().push(req.clone());
        if let Some(l) = req.loras.iter().find(|l| l.name == "xl_only") {
            return Err(EngineError::Invalid(ValidationError {
                field: "loras",
                message: format!("the LoRA `{}` does not fit this model (an SDXL LoRA on SD1)", l.name),
            }));
        }
        let _ = progress(&Progress { image: 0, images: 1, step: 1, steps: 1, preview: None });
        let seed = req.seed.unwrap_or(1);
        let ctx = InfotextContext { seed, width: 8, height: 8, model: "rec", version: "test" };
        let image = RgbImage { width: 8, height: 8, data: vec![128; 8 * 8 * 3] };
        Ok(GenerateOutput { images: vec![GeneratedImage { image, seed, infotext: infotext(req, &ctx) }] })
    }
}

/// Writes a safetensors file of F32 tensors with `metadata`; its data bytes follow a pattern.
fn write_st(path: &Path, tensors: &[(&str, &[u64])], metadata: &[(&str, &str)]) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut offset = 0u64;
    let mut entries = Vec::new();
    for (name, shape) in tensors {
        let bytes = shape.iter().product::<u64>() * 4;
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        entries.push(format!(
            r#""{name}":{{"dtype":"F32","shape":[{}],"data_offsets":[{offset},{}]}}"#,
            dims.join(","),
            offset + bytes
        ));
        offset += bytes;
    }
    let meta: Vec<String> = metadata.iter().map(|(k, v)| format!("{}:{}", json!(k), json!(v))).collect();
    let mut header = format!(r#"{{"__metadata__":{{{}}},{}}}"#, meta.join(","), entries.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend((0..offset).map(|i| (i * 13 % 251) as u8 ^ path.to_string_lossy().len() as u8));
    fs::write(path, bytes).unwrap();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A1111's addnet short hash, computed here from the bytes after the header.
fn addnet_short(path: &Path) -> String {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    hex(&Sha256::digest(&bytes[8 + n..]))[..12].to_string()
}

fn file_short(path: &Path) -> String {
    hex(&Sha256::digest(fs::read(path).unwrap()))[..12].to_string()
}

const KOHYA: &[(&str, &[u64])] = &[
    ("lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", &[4, 32]),
    ("lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight", &[32, 4]),
];

struct Fixture {
    _tmp: tempfile::TempDir,
    lora_dir: PathBuf,
    emb_dir: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let lora_dir = tmp.path().join("Lora");
    let emb_dir = tmp.path().join("embeddings");
    write_st(
        &lora_dir.join("styleA.safetensors"),
        KOHYA,
        &[("ss_output_name", "style_a"), ("ss_tag_frequency", r#"{"d": {"cat": 2}}"#)],
    );
    write_st(
        &lora_dir.join("sub/peft.safetensors"),
        &[("unet.down.to_q.lora_A.weight", &[4, 32]), ("unet.down.to_q.lora_B.weight", &[32, 4])],
        &[],
    );
    write_st(&lora_dir.join("xl_only.safetensors"), KOHYA, &[]);
    fs::write(lora_dir.join("pickled.pt"), b"\x80\x02pickle").unwrap();
    write_st(&emb_dir.join("EasyNegative.safetensors"), &[("emb_params", &[2, 768])], &[]);
    write_st(&emb_dir.join("xl_emb.safetensors"), &[("clip_l", &[1, 768]), ("clip_g", &[1, 1280])], &[]);
    Fixture { _tmp: tmp, lora_dir, emb_dir }
}

struct Server {
    base: String,
    http: reqwest::Client,
    seen: Arc<Mutex<Vec<GenerateRequest>>>,
}

async fn start(f: &Fixture) -> Server {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let config = ServerConfig {
        model_name: "rec".into(),
        networks: NetworksConfig {
            lora_dirs: vec![f.lora_dir.clone()],
            embeddings_dirs: vec![f.emb_dir.clone()],
            ..Default::default()
        },
        ..ServerConfig::default()
    };
    let state = AppState::new(config, Box::new(Recorder { seen: seen.clone() }));
    let app = sdhive_server::router(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Server { base: format!("http://{addr}"), http: reqwest::Client::new(), seen }
}

impl Server {
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, path: &str) -> Value {
        let r = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        r.json().await.unwrap()
    }

    fn last(&self) -> GenerateRequest {
        self.seen.lock().unwrap().last().cloned().expect("the engine ran a job")
    }

    async fn wait_job(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let job = self.get(&format!("/v1/jobs/{id}")).await;
            if ["succeeded", "failed", "cancelled"].contains(&job["state"].as_str().unwrap_or_default()) {
                return job;
            }
            assert!(Instant::now() < deadline, "job {id} did not finish");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn tags_and_structured_loras_reach_the_engine_with_hashes() {
    let f = fixture();
    let s = start(&f).await;
    let style = fs::canonicalize(f.lora_dir.join("styleA.safetensors")).unwrap();
    let peft = fs::canonicalize(f.lora_dir.join("sub/peft.safetensors")).unwrap();

    // Native job: a tag with te/unet multipliers, the alias, and the structured field.
    let (status, body) = s
        .post(
            "/v1/jobs",
            &json!({"prompt": "a cat <lora:style_a:0.5:0.25>", "steps": 1, "seed": 3,
                    "loras": [{"name": "peft", "weight": 0.8, "te_weight": -0.5}]}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let job = s.wait_job(body["id"].as_str().unwrap()).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    let req = s.last();
    assert_eq!(req.prompt, "a cat <lora:style_a:0.5:0.25>", "the prompt keeps its tags for the infotext");
    let got: Vec<(&str, &Path, f32, f32, Option<&str>)> = req
        .loras
        .iter()
        .map(|l| (l.name.as_str(), l.path.as_path(), l.te, l.unet, l.hash.as_deref()))
        .collect();
    let (hs, hp) = (addnet_short(&style), addnet_short(&peft));
    assert_eq!(
        got,
        vec![
            ("style_a", style.as_path(), 0.5, 0.25, Some(hs.as_str())),
            ("peft", peft.as_path(), -0.5, 0.8, Some(hp.as_str())),
        ]
    );

    // OpenAI: `<lyco:…>` alias with named multipliers.
    let (status, body) = s
        .post("/v1/images/generations", &json!({"prompt": "x <lyco:styleA:te=0.3:unet=0.7>", "steps": 1}))
        .await;
    assert_eq!(status, 200, "{body}");
    let l = &s.last().loras[0];
    assert_eq!((l.name.as_str(), l.te, l.unet), ("styleA", 0.3, 0.7));

    // A1111: tags in the prompt, an embedding in the negative prompt; both hashes in the infotext. The tag in
    // the negative prompt stays text, as in A1111.
    let (status, body) = s
        .post(
            "/sdapi/v1/txt2img",
            &json!({"prompt": "a dog <lora:styleA:0.8>", "negative_prompt": "(easynegative:1.2), <lora:peft:1>",
                    "steps": 1, "seed": 5}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let req = s.last();
    assert_eq!(req.loras.len(), 1);
    let emb = fs::canonicalize(f.emb_dir.join("EasyNegative.safetensors")).unwrap();
    assert_eq!(req.embeddings.len(), 1, "only the embedding that fits SD1 is used: {:?}", req.embeddings);
    assert_eq!((req.embeddings[0].name.as_str(), &req.embeddings[0].path), ("EasyNegative", &emb));
    let info: Value = serde_json::from_str(body["info"].as_str().unwrap()).unwrap();
    let text = info["infotexts"][0].as_str().unwrap();
    assert!(
        text.contains(&format!(
            "Lora hashes: \"styleA: {hs}\", TI hashes: \"EasyNegative: {}\", Version",
            file_short(&emb)
        )),
        "{text}"
    );
}

#[tokio::test]
async fn bad_names_and_tags_are_400s_naming_the_field() {
    let f = fixture();
    let s = start(&f).await;
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        ("/v1/jobs", json!({"prompt": "<lora:styleB:1>"}), "prompt", "no LoRA `styleB`; closest: styleA"),
        ("/v1/jobs", json!({"prompt": "x", "loras": [{"name": "nope"}]}), "loras", "no LoRA `nope`"),
        ("/v1/jobs", json!({"prompt": "<lora:pickled:1>"}), "prompt", "pickle"),
        ("/v1/jobs", json!({"prompt": "<lora:styleA:abc>"}), "prompt", "`<lora:styleA:abc>`"),
        ("/v1/jobs", json!({"prompt": "<hypernet:h:1>"}), "prompt", "hypernetworks"),
        ("/v1/jobs", json!({"prompt": "<lora:styleA><lora:style_a:0.5>"}), "prompt", "named twice"),
        ("/v1/images/generations", json!({"prompt": "<lora:styleB>"}), "prompt", "no LoRA `styleB`"),
        (
            "/v1/images/generations",
            json!({"prompt": "x", "loras": [{"name": "zzz"}]}),
            "loras",
            "no LoRA `zzz`",
        ),
    ];
    for (path, body, field, needle) in cases {
        let (status, answer) = s.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {answer}");
        assert_eq!(answer["error"]["param"], field, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message} lacks {needle}");
    }
    let (status, answer) =
        s.post("/sdapi/v1/txt2img", &json!({"prompt": "<lora:styleB:1>", "steps": 1})).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["field"], "prompt");
    assert!(answer["detail"].as_str().unwrap().contains("styleB"), "{answer}");
    assert!(s.seen.lock().unwrap().is_empty(), "nothing reached the engine");
}

#[tokio::test]
async fn engine_refusal_is_a_400_and_the_queue_goes_on() {
    let f = fixture();
    let s = start(&f).await;
    let (status, body) =
        s.post("/sdapi/v1/txt2img", &json!({"prompt": "<lora:xl_only:1>", "steps": 1})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], "loras");
    assert!(body["detail"].as_str().unwrap().contains("xl_only"), "{body}");
    let (status, body) =
        s.post("/v1/images/generations", &json!({"prompt": "<lora:xl_only:1>", "steps": 1})).await;
    assert_eq!((status, &body["error"]["param"]), (400, &json!("loras")), "{body}");

    let (_, body) = s.post("/v1/jobs", &json!({"prompt": "<lora:xl_only:1>", "steps": 1})).await;
    let job = s.wait_job(body["id"].as_str().unwrap()).await;
    assert_eq!(job["state"], "failed");
    assert_eq!(job["error"]["param"], "loras", "{job}");
    assert_eq!(job["error"]["kind"], "invalid_request", "{job}");

    let (_, body) = s.post("/v1/jobs", &json!({"prompt": "plain", "steps": 1})).await;
    assert_eq!(s.wait_job(body["id"].as_str().unwrap()).await["state"], "succeeded");
    assert!(s.last().loras.is_empty());
}

#[tokio::test]
async fn listings_and_refresh() {
    let f = fixture();
    let s = start(&f).await;
    let loras = s.get("/sdapi/v1/loras").await;
    let names: Vec<&str> = loras.as_array().unwrap().iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["peft", "styleA", "xl_only"]);
    let style = &loras[1];
    assert_eq!(style["alias"], "style_a");
    assert_eq!(
        style["path"],
        fs::canonicalize(f.lora_dir.join("styleA.safetensors")).unwrap().to_str().unwrap()
    );
    assert_eq!(style["metadata"]["ss_tag_frequency"], json!({"d": {"cat": 2}}));
    assert_eq!(style["metadata"]["ss_output_name"], "style_a");

    let emb = s.get("/sdapi/v1/embeddings").await;
    assert_eq!(
        emb,
        json!({
            "loaded": {"EasyNegative": {"step": null, "sd_checkpoint": null, "sd_checkpoint_name": null, "shape": 768, "vectors": 2}},
            "skipped": {"xl_emb": {"step": null, "sd_checkpoint": null, "sd_checkpoint_name": null, "shape": 2048, "vectors": 1}},
        })
    );

    // A file copied in later: listed after refresh, and found by a request even before (a miss rescans).
    write_st(&f.lora_dir.join("late.safetensors"), KOHYA, &[]);
    write_st(&f.emb_dir.join("late_emb.safetensors"), &[("emb_params", &[1, 768])], &[]);
    let (status, _) = s.post("/v1/images/generations", &json!({"prompt": "<lora:late:1>", "steps": 1})).await;
    assert_eq!(status, 200);
    let (status, _) = s.post("/sdapi/v1/refresh-embeddings", &json!({})).await;
    assert_eq!(status, 200);
    assert!(s.get("/sdapi/v1/embeddings").await["loaded"].get("late_emb").is_some());
    write_st(&f.lora_dir.join("later.safetensors"), KOHYA, &[]);
    let (status, _) = s.post("/sdapi/v1/refresh-loras", &json!({})).await;
    assert_eq!(status, 200);
    let names: Vec<String> = s
        .get("/sdapi/v1/loras")
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains(&"later".to_string()), "{names:?}");
}
