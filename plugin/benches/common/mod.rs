//! Helpers shared by the benchmarks: timing statistics and their table, plus the test helpers
//! (`tests/common`) that set up the same trees and processes.
#![allow(dead_code)]

use std::time::Duration;

#[path = "../../tests/common/mod.rs"]
mod test_common;
pub use test_common::*;

pub struct Stats {
    pub mean: Duration,
    pub median: Duration,
    pub p95: Duration,
}

pub fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort_unstable();
    let n = samples.len();
    Stats {
        mean: samples.iter().sum::<Duration>() / n as u32,
        median: samples[n / 2],
        p95: samples[(n * 95 / 100).min(n - 1)],
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// A table of timings: the header, then one row per [`Table::row`], names padded to `width`.
pub struct Table {
    width: usize,
}

impl Table {
    pub fn new(width: usize) -> Table {
        println!(
            "{:<width$} {:>10} {:>10} {:>10}",
            "", "mean", "median", "p95"
        );
        Table { width }
    }

    pub fn row(&self, name: &str, s: &Stats) {
        println!(
            "{name:<width$} {:>10} {:>10} {:>10}",
            ms(s.mean),
            ms(s.median),
            ms(s.p95),
            width = self.width
        );
    }
}
