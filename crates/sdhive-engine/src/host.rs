//! Models switched at run time: what a worker may be asked to load ([`ModelSpec`]), how a backend turns a spec
//! into an engine ([`EngineFactory`], one per engine family, which may keep a RAM cache behind it), and the
//! [`ModelHost`] that owns the one loaded engine, with `load_model` / `unload_model` / `current_model`. A switch
//! either completes or leaves the previous model serving: never a half-loaded model.

use crate::engine::{Engine, EngineInfo};
use std::path::PathBuf;
use thiserror::Error;

/// A checkpoint, and the VAE that replaces its own if any, as a worker is asked to load it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelSpec {
    /// The name the engine reports (infotext `Model:`, `/v1/info`).
    pub name: String,
    /// What the model source resolves: a canonical path from the catalogue, or the `--model` argument as given
    /// (a path or a Hugging Face repo id).
    pub source: String,
    /// A standalone VAE file (A1111's `sd_vae`); `None` keeps the checkpoint's own.
    pub vae: Option<PathBuf>,
}

impl ModelSpec {
    pub fn new(name: impl Into<String>, source: impl Into<String>) -> Self {
        ModelSpec { name: name.into(), source: source.into(), vae: None }
    }

    pub fn with_vae(mut self, vae: Option<PathBuf>) -> Self {
        self.vae = vae;
        self
    }
}

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Builds engines for one device. Implemented once per engine family; the host calls it for every switch.
pub trait EngineFactory: Send {
    /// Loads `spec` completely, or fails without side effects on anything already loaded.
    fn load(&mut self, spec: &ModelSpec) -> Result<Box<dyn Engine>, BoxError>;

    /// Takes an engine being switched away from. Its device memory must be free when this returns; a factory
    /// with a RAM cache keeps what it needs to rebuild the engine quickly.
    fn release(&mut self, _spec: &ModelSpec, engine: Box<dyn Engine>) {
        drop(engine);
    }
}

impl<F> EngineFactory for F
where
    F: FnMut(&ModelSpec) -> Result<Box<dyn Engine>, BoxError> + Send,
{
    fn load(&mut self, spec: &ModelSpec) -> Result<Box<dyn Engine>, BoxError> {
        self(spec)
    }
}

#[derive(Debug, Error)]
pub enum SwitchError {
    /// `spec` could not be loaded; `restored` says whether the previous model serves again.
    #[error("cannot load model `{name}`: {reason}")]
    Load { name: String, reason: String, restored: bool },
}

impl SwitchError {
    pub fn reason(&self) -> &str {
        match self {
            SwitchError::Load { reason, .. } => reason,
        }
    }
}

/// The one loaded model of a worker and the factory that loads others.
pub struct ModelHost {
    factory: Box<dyn EngineFactory>,
    loaded: Option<(ModelSpec, Box<dyn Engine>)>,
    /// What was loaded last, kept after an unload so a failed switch and `reload` know what to go back to.
    last: Option<ModelSpec>,
}

impl ModelHost {
    pub fn new(factory: Box<dyn EngineFactory>) -> Self {
        ModelHost { factory, loaded: None, last: None }
    }

    /// A host serving an engine loaded elsewhere as `spec`.
    pub fn with_engine(factory: Box<dyn EngineFactory>, spec: ModelSpec, engine: Box<dyn Engine>) -> Self {
        ModelHost { factory, loaded: Some((spec.clone(), engine)), last: Some(spec) }
    }

    pub fn current_model(&self) -> Option<&ModelSpec> {
        self.loaded.as_ref().map(|(spec, _)| spec)
    }

    /// The model loaded last, whether or not it still is.
    pub fn last_model(&self) -> Option<&ModelSpec> {
        self.last.as_ref()
    }

    pub fn info(&self) -> Option<EngineInfo> {
        self.loaded.as_ref().map(|(_, engine)| engine.info())
    }

    pub fn engine(&mut self) -> Option<&mut (dyn Engine + 'static)> {
        self.loaded.as_mut().map(|(_, engine)| engine.as_mut())
    }

    /// Makes `spec` the loaded model (nothing to do when it already is). The current model is released first,
    /// so two models never need the device at once; if `spec` fails, the previous model is loaded again.
    pub fn load_model(&mut self, spec: &ModelSpec) -> Result<(), SwitchError> {
        if self.current_model() == Some(spec) {
            return Ok(());
        }
        let previous = self.release_current().or_else(|| self.last.clone());
        match self.factory.load(spec) {
            Ok(engine) => {
                self.loaded = Some((spec.clone(), engine));
                self.last = Some(spec.clone());
                Ok(())
            }
            Err(e) => {
                let reason = error_chain(e.as_ref());
                tracing::warn!(model = %spec.name, "switch failed: {reason}");
                let restored = match previous {
                    Some(prev) => match self.factory.load(&prev) {
                        Ok(engine) => {
                            self.loaded = Some((prev, engine));
                            true
                        }
                        Err(e) => {
                            tracing::error!(model = %prev.name, "cannot reload the previous model: {}", error_chain(e.as_ref()));
                            false
                        }
                    },
                    None => false,
                };
                Err(SwitchError::Load { name: spec.name.clone(), reason, restored })
            }
        }
    }

    /// Frees the loaded model (A1111's unload-checkpoint); `last_model` still names it.
    pub fn unload_model(&mut self) {
        self.release_current();
    }

    fn release_current(&mut self) -> Option<ModelSpec> {
        let (spec, engine) = self.loaded.take()?;
        self.factory.release(&spec, engine);
        Some(spec)
    }
}

/// An error with its sources, as one line.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Control, EngineError, GenerateOutput, Progress};
    use crate::request::GenerateRequest;
    use std::sync::{Arc, Mutex};

    struct Fake(String);

    impl Engine for Fake {
        fn info(&self) -> EngineInfo {
            EngineInfo { engine: "fake".into(), model: self.0.clone(), ..EngineInfo::default() }
        }

        fn generate(
            &mut self,
            _: &GenerateRequest,
            _: &mut dyn FnMut(&Progress) -> Control,
        ) -> Result<GenerateOutput, EngineError> {
            Ok(GenerateOutput { images: vec![] })
        }
    }

    /// Loads any spec whose source does not start with `bad`; logs loads and releases.
    fn factory(log: Arc<Mutex<Vec<String>>>) -> Box<dyn EngineFactory> {
        struct F(Arc<Mutex<Vec<String>>>);
        impl EngineFactory for F {
            fn load(&mut self, spec: &ModelSpec) -> Result<Box<dyn Engine>, BoxError> {
                self.0.lock().unwrap().push(format!("load {}", spec.name));
                if spec.source.starts_with("bad") {
                    return Err("corrupt file".into());
                }
                Ok(Box::new(Fake(spec.name.clone())))
            }
            fn release(&mut self, spec: &ModelSpec, engine: Box<dyn Engine>) {
                self.0.lock().unwrap().push(format!("release {}", spec.name));
                drop(engine);
            }
        }
        Box::new(F(log))
    }

    #[test]
    fn switches_release_first_and_skip_reloading_the_same_model() {
        let log = Arc::new(Mutex::new(vec![]));
        let mut host = ModelHost::new(factory(log.clone()));
        let a = ModelSpec::new("a", "a");
        let b = ModelSpec::new("b", "b");
        host.load_model(&a).unwrap();
        host.load_model(&a).unwrap();
        host.load_model(&b).unwrap();
        assert_eq!(host.info().unwrap().model, "b");
        assert_eq!(*log.lock().unwrap(), ["load a", "release a", "load b"]);
    }

    #[test]
    fn a_failed_switch_restores_the_previous_model() {
        let log = Arc::new(Mutex::new(vec![]));
        let mut host = ModelHost::new(factory(log.clone()));
        let a = ModelSpec::new("a", "a");
        host.load_model(&a).unwrap();
        let err = host.load_model(&ModelSpec::new("x", "bad.safetensors")).unwrap_err();
        assert!(matches!(&err, SwitchError::Load { restored: true, .. }), "{err}");
        assert!(err.to_string().contains("corrupt file") && err.to_string().contains("`x`"), "{err}");
        assert_eq!(host.current_model(), Some(&a));
        assert_eq!(host.info().unwrap().model, "a");
        assert_eq!(*log.lock().unwrap(), ["load a", "release a", "load x", "load a"]);
    }

    #[test]
    fn unload_frees_and_a_failed_load_after_it_brings_back_the_last_model() {
        let log = Arc::new(Mutex::new(vec![]));
        let mut host = ModelHost::new(factory(log.clone()));
        let a = ModelSpec::new("a", "a");
        host.load_model(&a).unwrap();
        host.unload_model();
        assert!(host.current_model().is_none() && host.engine().is_none());
        assert_eq!(host.last_model(), Some(&a));
        assert!(host.load_model(&ModelSpec::new("x", "bad")).is_err());
        assert_eq!(host.current_model(), Some(&a));
    }

    #[test]
    fn vae_choice_is_part_of_the_identity() {
        let log = Arc::new(Mutex::new(vec![]));
        let mut host = ModelHost::new(factory(log.clone()));
        let plain = ModelSpec::new("a", "a");
        let with_vae = plain.clone().with_vae(Some("/v/x.safetensors".into()));
        host.load_model(&plain).unwrap();
        host.load_model(&with_vae).unwrap();
        assert_eq!(host.current_model(), Some(&with_vae));
        assert_eq!(log.lock().unwrap().len(), 3);
    }
}
