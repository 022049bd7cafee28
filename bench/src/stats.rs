//! Percentiles of a series of timings.

use std::time::Duration;

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Percentiles in milliseconds over the finite samples (NaN when there are none).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub n: usize,
}

impl Stats {
    /// No samples: a stage one pipeline does not have.
    pub const NONE: Stats = Stats { p50: f64::NAN, p90: f64::NAN, p99: f64::NAN, max: f64::NAN, n: 0 };

    pub fn of(mut v: Vec<f64>) -> Stats {
        v.retain(|x| x.is_finite());
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        Stats {
            p50: pct(&v, 0.5),
            p90: pct(&v, 0.9),
            p99: pct(&v, 0.99),
            max: v.last().copied().unwrap_or(f64::NAN),
            n: v.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_skip_missing_samples() {
        let s = Stats::of(vec![3.0, f64::NAN, 1.0, 2.0, 4.0]);
        assert_eq!((s.p50, s.p90, s.p99, s.max, s.n), (2.0, 4.0, 4.0, 4.0, 4));
        assert!(Stats::of(vec![]).p50.is_nan());
    }
}
