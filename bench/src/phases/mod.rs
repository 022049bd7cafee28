//! The measurements, one module per phase, each returning typed results
//! that `report` renders.

pub mod adopt;
pub mod backlog;
pub mod bridge;
pub mod burst;
pub mod idle;
pub mod latency;
pub mod scale;
