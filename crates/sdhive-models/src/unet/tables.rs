//! The products of the UNet's conditioning that every block would otherwise make on its own: each ResNet's
//! projection of the time embedding and each transformer block's k and v of the text context. Both inputs are
//! the same for every block of a call, so their weights are stacked at load into one matrix each, and a call
//! makes two products (one tall weight each) instead of one small product per block; the blocks read their
//! columns of the results in place. The context's table is kept while the caller passes the same context
//! ([`ContextTable`]); the time embedding's, for every timestep of a schedule, is made in one pass before a
//! denoising loop and each step reads its row ([`ScheduleTable`]).

use super::blocks::{DownBlock, MidBlock, UpBlock};
use crate::layers::stack_linears_opt;
use crate::ops;
use candle_core::{Result, Tensor, TensorId};
use candle_nn::Linear;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone)]
pub(crate) struct ConditioningTables {
    /// Every ResNet's `time_emb_proj`, weight `(ΣC, T)`.
    time: Option<Linear>,
    /// Every transformer block's `attn2.to_k` and `attn2.to_v`, weight `(Σ2·inner, Cctx)`.
    context: Option<Linear>,
}

impl ConditioningTables {
    /// Takes the projections over from the blocks, telling each where its columns will be.
    pub fn stack(down: &mut [DownBlock], mid: &mut MidBlock, up: &mut [UpBlock]) -> Result<Self> {
        let resnets = down
            .iter_mut()
            .flat_map(DownBlock::resnets_mut)
            .chain(mid.resnets_mut())
            .chain(up.iter_mut().flat_map(UpBlock::resnets_mut));
        let time = stack_handed_over(resnets, |r, offset| r.hand_over_time_projection(offset))?;
        let transformers = down
            .iter_mut()
            .flat_map(DownBlock::transformers_mut)
            .chain(mid.transformers_mut())
            .chain(up.iter_mut().flat_map(UpBlock::transformers_mut));
        let attentions = transformers.flat_map(|t| t.context_attentions_mut());
        let context = stack_handed_over(attentions, |a, offset| a.hand_over_context_kv(offset))?;
        Ok(Self { time, context })
    }

    /// What the ResNets take for the activated time embedding `(B, T)`: the `(B, ΣC)` table of their projections.
    pub fn time(&self, activated: &Tensor) -> Result<Tensor> {
        table(&self.time, activated)
    }

    /// What the transformer blocks take for the text context `(B, T, Cctx)`: the `(B, T, Σ2·inner)` table of
    /// their k and v.
    pub fn context(&self, context: &Tensor) -> Result<Tensor> {
        table(&self.context, context)
    }
}

/// The stacked product of `input`, or `input` itself where no block handed a linear over.
fn table(stacked: &Option<Linear>, input: &Tensor) -> Result<Tensor> {
    match stacked {
        Some(l) => ops::linear(l, input, None),
        None => Ok(input.clone()),
    }
}

/// The linears `hand_over` takes from each module, stacked in that order, each module told the column its
/// outputs will start at.
fn stack_handed_over<'a, M: 'a>(
    modules: impl Iterator<Item = &'a mut M>,
    hand_over: impl Fn(&mut M, usize) -> Option<Linear>,
) -> Result<Option<Linear>> {
    let mut parts = Vec::new();
    let mut offset = 0;
    for module in modules {
        if let Some(part) = hand_over(module, offset) {
            offset += part.weight().dim(0)?;
            parts.push(part);
        }
    }
    stack_linears_opt(&parts)
}

/// The last text context's table of k and v. A denoising loop hands the network one context tensor for all its
/// steps, so the table is made once per image instead of once per step (SD1.5 at batch 2: a 22 µs product of a
/// 6 ms step on an H100), and the step's CUDA graph finds that input unchanged. Another context tensor replaces
/// it. Shared by the network's clones, as the weights are.
#[derive(Clone, Default)]
pub(crate) struct ContextTable {
    last: Arc<Mutex<Option<(TensorId, Tensor)>>>,
}

impl std::fmt::Debug for ContextTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ContextTable")
    }
}

impl ContextTable {
    /// Forgets the table (the weights it was made with changed).
    pub fn clear(&self) {
        *self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }

    /// `make(context)`, made again only when `context` is not the tensor of the last call. Tensors are immutable
    /// and their ids never reused, so the id stands for the values.
    pub fn get(&self, context: &Tensor, make: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let mut last = self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((id, table)) = last.as_ref() {
            if *id == context.id() {
                return Ok(table.clone());
            }
        }
        // The old table goes before the new one is made, so two are never held at once.
        *last = None;
        let table = make(context)?;
        *last = Some((context.id(), table.clone()));
        Ok(table)
    }
}

/// The time table `(B, ΣC)` of every timestep of a denoising schedule, made in one pass: row `i` of `(n, B, ΣC)`
/// for the schedule's `i`-th distinct timestep. A step then reads its row instead of running the time MLP and
/// the stacked projection (SD1.5: 51.6 MB of weights read per step, about 50 µs of a 5.5 ms step on an H100).
/// Kept for one schedule, batch and SDXL conditioning at a time; shared by the network's clones.
#[derive(Clone, Default)]
pub(crate) struct ScheduleTable {
    last: Arc<Mutex<Option<Schedule>>>,
}

impl std::fmt::Debug for ScheduleTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScheduleTable")
    }
}

/// What a table's rows depend on besides the timestep: the batch and the identities of SDXL's conditioning
/// tensors (immutable, ids never reused).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct ScheduleKey {
    pub batch: usize,
    pub added: Option<(TensorId, TensorId)>,
}

struct Schedule {
    key: ScheduleKey,
    /// The distinct timesteps as bit patterns: a step's timestep comes from the same list, so it matches exactly.
    timesteps: Vec<u64>,
    /// `(n, B, ΣC)`.
    rows: Tensor,
}

impl ScheduleTable {
    /// Forgets the table (the weights it was made with changed).
    pub fn clear(&self) {
        *self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }

    /// The distinct timesteps of `timesteps` (in order; second-order samplers evaluate some twice) when the table
    /// held is not already theirs for `key`, dropping the old table so two are never held at once; `None` when
    /// nothing needs making.
    pub fn missing(&self, timesteps: &[f64], key: ScheduleKey) -> Option<Vec<f64>> {
        let mut distinct: Vec<f64> = Vec::with_capacity(timesteps.len());
        for &t in timesteps {
            if !distinct.iter().any(|d| d.to_bits() == t.to_bits()) {
                distinct.push(t);
            }
        }
        let bits: Vec<u64> = distinct.iter().map(|t| t.to_bits()).collect();
        let mut last = self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if last.as_ref().is_some_and(|s| s.key == key && s.timesteps == bits) {
            return None;
        }
        *last = None;
        (!distinct.is_empty()).then_some(distinct)
    }

    /// Keeps `rows` `(n, B, ΣC)` as the table of `distinct` (from [`Self::missing`]) for `key`.
    pub fn store(&self, distinct: &[f64], key: ScheduleKey, rows: Tensor) -> Result<()> {
        let (n, b, _) = rows.dims3()?;
        if n != distinct.len() || b != key.batch {
            candle_core::bail!(
                "schedule table is {:?}, expected {} timesteps × batch {}",
                rows.dims(),
                distinct.len(),
                key.batch
            );
        }
        let timesteps = distinct.iter().map(|t| t.to_bits()).collect();
        *self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) =
            Some(Schedule { key, timesteps, rows });
        Ok(())
    }

    /// The `(B, ΣC)` row of `timestep` when the table held was made for it and for `key`.
    pub fn row(&self, timestep: f64, key: ScheduleKey) -> Result<Option<Tensor>> {
        let last = self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(schedule) = last.as_ref().filter(|s| s.key == key) else {
            return Ok(None);
        };
        match schedule.timesteps.iter().position(|&b| b == timestep.to_bits()) {
            Some(i) => Ok(Some(schedule.rows.get(i)?)),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ContextTable, ScheduleKey, ScheduleTable};
    use candle_core::{Device, Tensor};
    use std::cell::Cell;

    /// Row `i` of a schedule's table is its `i`-th distinct timestep's, found by exact value; another batch,
    /// another SDXL conditioning or a timestep off the schedule finds none, and the same schedule is not made
    /// twice.
    #[test]
    fn a_schedule_table_gives_each_timestep_its_row() {
        let dev = Device::Cpu;
        let table = ScheduleTable::default();
        let key = ScheduleKey { batch: 2, added: None };
        let made = Cell::new(0);
        // Each row holds its timestep in every column, per batch entry `t + b`.
        let make = |ts: &[f64]| {
            made.set(made.get() + 1);
            let v: Vec<f32> =
                ts.iter().flat_map(|&t| (0..2).flat_map(move |b| [t as f32 + b as f32; 3])).collect();
            Tensor::from_vec(v, (ts.len(), 2, 3), &dev)
        };
        let prepare = |ts: &[f64]| {
            if let Some(distinct) = table.missing(ts, key) {
                table.store(&distinct, key, make(&distinct).unwrap()).unwrap();
            }
        };
        let schedule = [999.0, 949.5, 949.5, 899.0];
        prepare(&schedule);
        assert_eq!(made.get(), 1);
        let row = table.row(949.5, key).unwrap().expect("on the schedule");
        assert_eq!(row.to_vec2::<f32>().unwrap(), vec![vec![949.5; 3], vec![950.5; 3]]);
        let row = table.row(899.0, key).unwrap().expect("on the schedule");
        assert_eq!(row.to_vec2::<f32>().unwrap(), vec![vec![899.0; 3], vec![900.0; 3]]);
        assert!(table.row(949.0, key).unwrap().is_none(), "off the schedule");
        assert!(table.row(999.0, ScheduleKey { batch: 1, added: None }).unwrap().is_none(), "another batch");
        let a = Tensor::zeros(1, candle_core::DType::F32, &dev).unwrap();
        let sdxl = ScheduleKey { batch: 2, added: Some((a.id(), a.id())) };
        assert!(table.row(999.0, sdxl).unwrap().is_none(), "another conditioning");

        prepare(&schedule);
        assert_eq!(made.get(), 1, "the same schedule is not made twice");
        prepare(&[10.0]);
        assert_eq!(made.get(), 2);
        assert!(table.row(999.0, key).unwrap().is_none(), "the old schedule is gone");
        let wrong = Tensor::zeros((1, 2, 3), candle_core::DType::F32, &dev).unwrap();
        assert!(table.store(&[1.0, 2.0], key, wrong).is_err(), "rows must match the timesteps");
    }

    /// The table is made once per context tensor: again for another tensor, even one of equal values (the cache
    /// goes by identity, not content), and the same values come back.
    #[test]
    fn a_context_table_is_made_once_per_context_tensor() {
        let dev = Device::Cpu;
        let cache = ContextTable::default();
        let made = Cell::new(0);
        let make = |c: &Tensor| {
            made.set(made.get() + 1);
            c * 2.0
        };
        let a = Tensor::arange(0f32, 6., &dev).unwrap();
        let first = cache.get(&a, make).unwrap();
        let again = cache.get(&a, make).unwrap();
        assert_eq!(made.get(), 1);
        assert_eq!(again.to_vec1::<f32>().unwrap(), first.to_vec1::<f32>().unwrap());
        let b = a.copy().unwrap();
        let other = cache.get(&b, make).unwrap();
        assert_eq!(made.get(), 2, "another tensor of the same values is another context");
        assert_eq!(other.to_vec1::<f32>().unwrap(), vec![0., 2., 4., 6., 8., 10.]);
        assert!(cache.get(&b, |_| candle_core::bail!("must not be made again")).is_ok());
    }
}
