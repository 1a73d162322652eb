//! The `step_index` / `begin_index` bookkeeping of diffusers' sigma-based
//! schedulers.
//!
//! diffusers ignores the timestep passed to `step` except on the very first
//! call, where it looks the timestep up in the schedule (taking the *second*
//! match when a value repeats, so img2img never skips a sigma) unless the
//! pipeline fixed the start with `set_begin_index`. From then on an internal
//! counter rules. Reproducing that, rather than trusting the caller's index,
//! keeps odd schedules (repeated timesteps) identical to diffusers.

use crate::error::{Result, SchedulerError};

/// What `index_for_timestep` does when the timestep is not in the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missing {
    /// Euler / LCM: an `IndexError` in diffusers.
    Error,
    /// DPM-Solver: falls back to the last index.
    Last,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Cursor {
    pub begin: Option<usize>,
    pub step: Option<usize>,
}

/// Position of `timesteps[i]` as diffusers' `index_for_timestep` finds it.
pub(crate) fn index_for_timestep(
    class: &'static str,
    timesteps: &[f64],
    i: usize,
    missing: Missing,
) -> Result<usize> {
    let Some(&t) = timesteps.get(i) else {
        return Err(SchedulerError::IndexOutOfRange { class, index: i, len: timesteps.len() });
    };
    let mut matches = timesteps.iter().enumerate().filter(|(_, &v)| v == t).map(|(j, _)| j);
    let first = matches.next();
    let second = matches.next();
    match (first, second) {
        (_, Some(j)) => Ok(j),
        (Some(j), None) => Ok(j),
        // Only reachable for NaN timesteps.
        (None, None) => match missing {
            Missing::Last => Ok(timesteps.len() - 1),
            Missing::Error => Err(SchedulerError::IndexOutOfRange { class, index: i, len: timesteps.len() }),
        },
    }
}

impl Cursor {
    /// The current step index, initialising it from the caller's timestep
    /// index `i` on first use (diffusers' `_init_step_index`).
    pub fn current(
        &mut self,
        class: &'static str,
        timesteps: &[f64],
        i: usize,
        missing: Missing,
    ) -> Result<usize> {
        if let Some(s) = self.step {
            return Ok(s);
        }
        let s = match self.begin {
            Some(b) => b,
            None => index_for_timestep(class, timesteps, i, missing)?,
        };
        self.step = Some(s);
        Ok(s)
    }

    pub fn advance(&mut self) {
        self.step = self.step.map(|s| s + 1);
    }

    /// The sigma index diffusers' `add_noise` uses for `timesteps[i]`.
    pub fn noise_index(
        &self,
        class: &'static str,
        timesteps: &[f64],
        i: usize,
        missing: Missing,
    ) -> Result<usize> {
        match (self.begin, self.step) {
            (None, _) => index_for_timestep(class, timesteps, i, missing),
            (Some(_), Some(s)) => Ok(s),
            (Some(b), None) => Ok(b),
        }
    }
}
