//! Skip-layer guidance on the wire: the `skip_layer_guidance` object of native jobs, OpenAI generations and A1111
//! `txt2img` bodies, one shape everywhere (`docs/api.md`, "Skip-layer guidance"). Unset fields take diffusers'
//! `StableDiffusion3Pipeline` defaults; the server checks the values and names the field it refuses.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkipLayerGuidanceRequest {
    /// The transformer blocks the extra pass leaves out, counted from 0 (SD3.5-medium: `[7, 8, 9]`).
    pub layers: Vec<u32>,
    /// How far the prediction moves away from the pass without those blocks (default 2.8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f64>,
    /// The window, as fractions of the steps: the pass runs at steps `i` with `steps·start < i < steps·stop`
    /// (defaults 0.01 and 0.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_required_and_unknown_fields_refused() {
        let r: SkipLayerGuidanceRequest =
            serde_json::from_str(r#"{"layers":[7,8,9],"scale":3}"#).expect("parse");
        assert_eq!((r.layers, r.scale, r.start, r.stop), (vec![7, 8, 9], Some(3.0), None, None));
        let e = serde_json::from_str::<SkipLayerGuidanceRequest>(r#"{"scale":3}"#).expect_err("no layers");
        assert!(e.to_string().contains("layers"), "{e}");
        let e = serde_json::from_str::<SkipLayerGuidanceRequest>(r#"{"layers":[1],"end":0.2}"#)
            .expect_err("typo");
        assert!(e.to_string().contains("end"), "{e}");
        let e = serde_json::from_str::<SkipLayerGuidanceRequest>(r#"{"layers":[-1]}"#).expect_err("negative");
        assert!(e.to_string().contains("-1"), "{e}");
    }
}
