//! `decode` on one rank: load this rank's shard, establish the communicator, run the shared
//! generation loop. Rank 0 publishes each token into the control block's token ring (the
//! coordinator streams the text) and reports the statistics at the end.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tprun_ipc::{Conn, Msg, Phase};
use tprun_kernels::Device;

use crate::comm::Communicator;
use crate::job::{self, Backend, DecodeSpec, Report};
use crate::model::{generate, GenerateOptions, LoadOptions, Model, Sampler, SamplerConfig};
use crate::run::RankCtx;
use crate::RankError;

#[allow(clippy::too_many_arguments)]
pub fn run<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: Arc<D>,
    backend: Backend,
    spec: &DecodeSpec,
    timeout: Duration,
    spin: u32,
) -> Result<(), RankError> {
    ctx.enter(Phase::Loading);
    let t0 = Instant::now();
    let opts = LoadOptions {
        dtype: spec.dtype,
        ..LoadOptions::default()
    };
    // Loading a large shard is disk-bound and may outlast --timeout; it beats on its own
    // thread meanwhile so that the coordinator does not take it for a stall.
    let mut model = ctx.beating(|| {
        Model::load(
            dev.clone(),
            Path::new(&spec.model),
            ctx.rank,
            ctx.world,
            &opts,
        )
    })?;
    if ctx.rank == 0 {
        report(
            conn,
            &Report::Loaded {
                seconds: t0.elapsed().as_secs_f64(),
            },
        )?;
    }
    let mut comm = Communicator::establish(
        dev,
        conn,
        ctx.control.clone(),
        ctx.rank,
        backend,
        model.max_allreduce_bytes(),
        timeout,
        spin,
    )?;
    ctx.enter(Phase::Prefill);
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: spec.temperature,
        top_k: spec.top_k,
        top_p: spec.top_p,
        seed: spec.seed,
    });
    let gen = GenerateOptions {
        max_new_tokens: spec.max_new_tokens,
        stop: spec.stop.clone(),
    };
    let mut steps = Vec::with_capacity(spec.max_new_tokens);
    let mut last: Option<Instant> = None;
    let control = ctx.control.clone();
    let rank = ctx.rank;
    let stats = generate(
        &mut model,
        &mut comm,
        &mut sampler,
        &spec.prompt,
        &gen,
        &mut |id| {
            let now = Instant::now();
            match last {
                None => ctx.enter(Phase::Decode),
                Some(t) => steps.push((now - t).as_secs_f32() * 1e6),
            }
            last = Some(now);
            if rank == 0 {
                control.push_token(id, timeout)?;
            }
            control.beat(rank);
            Ok(true)
        },
    )?;
    comm.close()?;
    if ctx.rank == 0 {
        report(
            conn,
            &Report::Decode {
                prompt_tokens: stats.prompt_tokens,
                generated: stats.generated,
                stopped: stats.stopped,
                prefill_s: stats.prefill.as_secs_f64(),
                decode_s: stats.decode.as_secs_f64(),
                step_us: steps,
            },
        )?;
    }
    Ok(())
}

fn report(conn: &Conn, r: &Report) -> Result<(), RankError> {
    conn.send(
        &Msg::Report {
            payload: job::encode(r),
        },
        &[],
    )?;
    Ok(())
}
