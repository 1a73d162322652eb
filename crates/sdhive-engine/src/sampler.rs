//! Sampler and noise-schedule names as AUTOMATIC1111 users write them, mapped to the samplers the engines run.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The denoising algorithm. Names follow A1111; each maps onto one diffusers scheduler class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Sampler {
    Euler,
    EulerA,
    Ddim,
    DpmPp2M,
    Lcm,
    Pndm,
}

/// How the noise levels are spaced. `Automatic` means "whatever the model's scheduler config says".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Schedule {
    #[default]
    Automatic,
    Karras,
}

impl Sampler {
    pub const ALL: [Sampler; 6] =
        [Sampler::Euler, Sampler::EulerA, Sampler::Ddim, Sampler::DpmPp2M, Sampler::Lcm, Sampler::Pndm];

    /// The canonical A1111 display name.
    pub fn name(self) -> &'static str {
        match self {
            Sampler::Euler => "Euler",
            Sampler::EulerA => "Euler a",
            Sampler::Ddim => "DDIM",
            Sampler::DpmPp2M => "DPM++ 2M",
            Sampler::Lcm => "LCM",
            Sampler::Pndm => "PNDM",
        }
    }

    /// Other spellings A1111 and its API clients send (k-diffusion function names, config keys).
    pub fn aliases(self) -> &'static [&'static str] {
        match self {
            Sampler::Euler => &["k_euler", "euler"],
            Sampler::EulerA => &["k_euler_a", "euler_a", "euler_ancestral", "k_euler_ancestral"],
            Sampler::Ddim => &["ddim"],
            Sampler::DpmPp2M => &["k_dpmpp_2m", "dpmpp_2m", "dpm++2m", "dpmpp2m"],
            Sampler::Lcm => &["k_lcm", "lcm"],
            Sampler::Pndm => &["plms", "pndm"],
        }
    }

    /// Whether a Karras schedule is meaningful for this sampler (the diffusers class has `use_karras_sigmas`).
    pub fn supports_karras(self) -> bool {
        matches!(self, Sampler::Euler | Sampler::DpmPp2M)
    }

    /// Parses a sampler name as A1111 accepts it. The older combined names (`DPM++ 2M Karras`) carry their
    /// schedule; a plain name yields `None` for the schedule so an explicit `--scheduler` can still apply.
    pub fn parse(name: &str) -> Option<(Sampler, Option<Schedule>)> {
        let trimmed = name.trim();
        let lower = trimmed.to_ascii_lowercase();
        let (base, schedule) = match lower.strip_suffix(" karras").or_else(|| lower.strip_suffix("_karras")) {
            Some(base) => (base.trim().to_string(), Some(Schedule::Karras)),
            None => (lower.clone(), None),
        };
        let sampler = Sampler::ALL.into_iter().find(|s| {
            s.name().eq_ignore_ascii_case(&base) || s.aliases().iter().any(|a| a.eq_ignore_ascii_case(&base))
        })?;
        Some((sampler, schedule))
    }
}

impl Schedule {
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Automatic => "Automatic",
            Schedule::Karras => "Karras",
        }
    }

    pub fn parse(name: &str) -> Option<Schedule> {
        match name.trim().to_ascii_lowercase().as_str() {
            "automatic" | "default" | "" => Some(Schedule::Automatic),
            "karras" => Some(Schedule::Karras),
            _ => None,
        }
    }
}

impl fmt::Display for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a1111_names_and_aliases() {
        assert_eq!(Sampler::parse("Euler a"), Some((Sampler::EulerA, None)));
        assert_eq!(Sampler::parse("k_euler_a"), Some((Sampler::EulerA, None)));
        assert_eq!(Sampler::parse("DPM++ 2M"), Some((Sampler::DpmPp2M, None)));
        assert_eq!(Sampler::parse("DPM++ 2M Karras"), Some((Sampler::DpmPp2M, Some(Schedule::Karras))));
        assert_eq!(Sampler::parse("dpmpp_2m_karras"), Some((Sampler::DpmPp2M, Some(Schedule::Karras))));
        assert_eq!(Sampler::parse(" ddim "), Some((Sampler::Ddim, None)));
        assert_eq!(Sampler::parse("PLMS"), Some((Sampler::Pndm, None)));
        assert_eq!(Sampler::parse("LCM"), Some((Sampler::Lcm, None)));
        assert_eq!(Sampler::parse("Heun"), None);
        assert_eq!(Sampler::parse(""), None);
    }

    #[test]
    fn every_canonical_name_round_trips() {
        for s in Sampler::ALL {
            assert_eq!(Sampler::parse(s.name()), Some((s, None)));
        }
    }
}
