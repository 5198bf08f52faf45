//! The fragmentation benchmark behind `carve bench fragmentation`: replays the
//! openb trace (Weng et al., ATC '23) mapped onto MIG profiles, with the
//! Monte-Carlo inflation protocol of the FGD paper, and compares device-order
//! policies (NVIDIA's name order, first-fit, best-fit, random, carve's order, a
//! state-aware order republished after each prepare and unprepare
//! ([`live_order`], measured and not kept), a re-packing heuristic) by the
//! compute slices they leave unallocated: against
//! the exact per-node optimum ([`optimum`], clairvoyant) and the optimal
//! online policy of the same model ([`online`], exact dynamic programming on
//! the shapes it can solve), and inside a modelled
//! kube-scheduler under both `NodeResourcesFit` strategies, with each failure
//! classified by cause ([`FailCause`]); [`run_suite`] runs it all side by side.
//!
//! It is a pure, synchronous library: it reads CSV files, simulates and writes
//! one CSV. It is not a scheduler, talks to no cluster and no GPU. The node
//! choice models kube-scheduler's default scoring; the device choice models the
//! DRA allocator (first free device in published order). An optional churn mode
//! ([`run_churn`]) adds Poisson arrivals and departures.

pub mod bench;
pub mod churn;
mod csvout;
pub mod error;
pub mod live_order;
pub mod mapping;
pub mod online;
pub mod optimum;
pub mod rng;
pub mod sim;
pub mod suite;
#[cfg(test)]
mod test_tasks;
pub mod trace;

pub use bench::{
    BenchConfig, BenchReport, Metric, REPORT_POINTS, Sample, parse_seeds, run, sample_nodes,
};
pub use churn::{ChurnConfig, ChurnReport, ChurnRow, run_churn};
pub use error::FragError;
pub use mapping::{Demand, InternalFrag, Mapper};
pub use online::OnlineOptimum;
pub use optimum::{NodeOptimum, NodeReference, NodeShape};
pub use sim::{FailCause, Policy, Scoring, Totals};
pub use suite::{
    BAND, ClusterRun, ClusterShape, ClusterSummary, SeedFigures, SuiteConfig, SuiteReport,
    run_suite,
};
