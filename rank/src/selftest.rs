//! `selftest` on a rank: every GPU kernel against its CPU twin on this rank's device, the
//! results reported to the coordinator, which only prints them (device work runs in ranks).
//! The CPU ops need no check here: they are the reference (their own tests compare them with
//! f64).

use tprun_ipc::{Conn, Msg};
use tprun_kernels::cuda;

use crate::job::{self, Backend, JobSpec, Report, SelftestSpec};
use crate::run::RankCtx;
use crate::{Phase, RankError};

pub fn run(
    ctx: &RankCtx,
    conn: &Conn,
    spec: &JobSpec,
    selftest: &SelftestSpec,
) -> Result<(), RankError> {
    ctx.enter(Phase::Selftest);
    let results = match spec.backend {
        // CUDA_VISIBLE_DEVICES (set by the coordinator) makes our device ordinal 0. The checks
        // open their own devices (several "ranks" as threads) and take a while: beat meanwhile.
        Backend::Cuda => {
            ctx.beating(|| cuda::selftest(cuda::Gpu::Cuda, 0, spec.ipc, selftest.seed))?
        }
        Backend::Hip => {
            ctx.beating(|| cuda::selftest(cuda::Gpu::Hip, 0, spec.ipc, selftest.seed))?
        }
        Backend::Cpu => Vec::new(),
    };
    let report = Report::Selftest {
        checks: results.len() as u64,
        failed: results.into_iter().filter(|r| !r.ok).collect(),
    };
    conn.send(
        &Msg::Report {
            payload: job::encode(&report),
        },
        &[],
    )?;
    Ok(())
}
