//! Where a joined batch's device time goes, for the debug log: the device time of each piece of work the engine
//! thread queues ([`Site`]: admitting requests, steps by their number of images, decodes), the host's time queuing
//! it, and how long the device sat idle waiting for the host before each. Measured with marks the device passes
//! (read without waiting) and only while `sdhive_candle::engine::ledger=debug` is logged, so a worker without that
//! level records nothing.

use candle_core::Device;
use sdhive_cuda_kernels::{mark, Mark};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Instant;

/// A piece of the engine thread's work.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) enum Site {
    /// Requests admitted (their prompts encoded) and their images' lanes started.
    Admit,
    /// One denoising step of this many images.
    Step(usize),
    /// Progress reports (previews) and the decodes of images whose schedules ended.
    Decode,
}

/// What an interval between two marks measures.
#[derive(Clone, Copy, PartialEq)]
enum Span {
    /// The device waiting for the host before a site's work.
    Idle,
    /// The site's work.
    Work,
}

#[derive(Default)]
struct Account {
    count: u64,
    device_ms: f64,
    host_ms: f64,
    idle_ms: f64,
}

pub(super) struct Ledger {
    device: Option<Device>,
    /// The mark after the last work queued: once the device passes it, it has nothing to do.
    tail: Option<Rc<Mark>>,
    /// The site being queued now, the mark at its start and when the host began queuing it.
    open: Option<(Site, Rc<Mark>, Instant)>,
    /// Intervals whose marks the device may not have passed yet.
    pending: Vec<(Site, Span, Rc<Mark>, Rc<Mark>)>,
    sites: BTreeMap<Site, Account>,
    started: Instant,
}

impl Ledger {
    pub(super) fn new(device: &Device) -> Self {
        let on = tracing::enabled!(tracing::Level::DEBUG);
        Ledger {
            device: on.then(|| device.clone()),
            tail: None,
            open: None,
            pending: Vec::new(),
            sites: BTreeMap::new(),
            started: Instant::now(),
        }
    }

    /// `site`'s work is about to be queued: a device past the last tail has idled since it.
    pub(super) fn resume(&mut self, site: Site) {
        let Some(device) = &self.device else { return };
        let idle = self.tail.take().filter(|tail| tail.passed());
        let Ok(now) = mark(device).map(Rc::new) else { return };
        if let Some(tail) = idle {
            self.pending.push((site, Span::Idle, tail, Rc::clone(&now)));
        }
        self.open = Some((site, now, Instant::now()));
    }

    /// The open site's work has been queued.
    pub(super) fn queued(&mut self) {
        let Some(device) = &self.device else { return };
        let Ok(end) = mark(device).map(Rc::new) else { return };
        if let Some((site, start, began)) = self.open.take() {
            self.sites.entry(site).or_default().host_ms += began.elapsed().as_secs_f64() * 1e3;
            self.pending.push((site, Span::Work, start, Rc::clone(&end)));
        }
        self.tail = Some(end);
        self.read(false);
    }

    /// Books the intervals the device has passed (`all`: drops the rest).
    fn read(&mut self, all: bool) {
        let sites = &mut self.sites;
        self.pending.retain(|(site, span, a, b)| {
            let Some(ms) = b.ms_since(a) else { return !all };
            let account = sites.entry(*site).or_default();
            match span {
                Span::Idle => account.idle_ms += ms,
                Span::Work => {
                    account.count += 1;
                    account.device_ms += ms;
                }
            }
            false
        });
    }

    /// Logs the run's account (what the device has passed of it).
    pub(super) fn report(mut self) {
        if self.device.is_none() {
            return;
        }
        self.read(true);
        let total = |f: fn(&Account) -> f64| self.sites.values().map(f).sum::<f64>();
        let sites: Vec<String> = self
            .sites
            .iter()
            .map(|(site, a)| {
                let name = match site {
                    Site::Admit => "admit".to_string(),
                    Site::Step(n) => format!("step{n}"),
                    Site::Decode => "decode".to_string(),
                };
                let per = |ms: f64| ms / a.count.max(1) as f64;
                format!(
                    "{name}:{}x{:.2}ms(host {:.2})+idle{:.1}",
                    a.count,
                    per(a.device_ms),
                    per(a.host_ms),
                    a.idle_ms
                )
            })
            .collect();
        tracing::debug!(
            wall_ms = format!("{:.1}", self.started.elapsed().as_secs_f64() * 1e3),
            device_ms = format!("{:.1}", total(|a| a.device_ms)),
            idle_ms = format!("{:.1}", total(|a| a.idle_ms)),
            sites = sites.join(" "),
            "joined run's device time"
        );
    }
}
