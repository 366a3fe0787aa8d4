//! A `serve` job on one rank: load the shard, join the communicator, then generate each
//! request the coordinator sends (`Msg::Work`), one sequence at a time, until it says stop.
//!
//! Every rank receives the same requests in the same order and runs them in lockstep (the
//! same sampler seed per request, so the same tokens); rank 0 publishes the tokens through the
//! control block's token ring and reports the end of each request. A request the coordinator
//! cancels (through the control block) ends early at a token count rank 0 picks and every
//! rank follows. A rank waiting for work beats, so an idle server is not taken for a stalled
//! job.

use std::sync::Arc;
use std::time::Duration;

use tprun_ipc::control::describe_abort;
use tprun_ipc::{Conn, IpcError, Msg};
use tprun_kernels::Device;

use crate::comm::Communicator;
use crate::decode::{load, report};
use crate::job::{self, Backend, GenRequest, Report, ServeSpec, Work};
use crate::model::{generate, GenerateOptions, Model, SamplerConfig};
use crate::run::RankCtx;
use crate::{Phase, RankError};

/// Tokens past rank 0's sight of a cancel at which every rank ends the request (see
/// `serve_one`).
const EARLY_STOP_MARGIN: u64 = 3;

pub fn run<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: Arc<D>,
    backend: Backend,
    spec: &ServeSpec,
    timeout: Duration,
    spin: u32,
) -> Result<(), RankError> {
    let mut model = load(
        ctx,
        conn,
        dev.clone(),
        &spec.model,
        spec.dtype,
        spec.kv_dtype,
        spec.max_seq,
    )?;
    model.set_graph(spec.graph);
    let mut comm = Communicator::establish(
        dev,
        conn,
        ctx,
        backend,
        model.max_allreduce_bytes(),
        timeout,
        spin,
    )?;
    if ctx.rank == 0 {
        report(conn, &Report::Ready)?;
    }
    loop {
        ctx.enter(Phase::Idle);
        let work = ctx.beating(|| next_work(ctx, conn))?;
        match work {
            Work::Shutdown => break,
            Work::Generate(req) => serve_one(ctx, conn, &mut model, &mut comm, &req, timeout)?,
        }
    }
    comm.close()?;
    Ok(())
}

/// Waits for the coordinator's next `Msg::Work`. The coordinator hangs up on an aborted job:
/// that is then the abort (another rank failed first), not a failure of ours.
fn next_work(ctx: &RankCtx, conn: &Conn) -> Result<Work, RankError> {
    let (msg, _) = conn.recv(None).map_err(|e| match ctx.control.aborted() {
        Some((reason, who)) => IpcError::Aborted(describe_abort(reason, who)),
        None => e,
    })?;
    match msg {
        Msg::Work { payload } => Ok(job::decode(&payload)?),
        other => Err(RankError::Other(format!(
            "expected work from the coordinator, got {other:?}"
        ))),
    }
}

fn serve_one<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    model: &mut Model<D>,
    comm: &mut Communicator<D>,
    req: &GenRequest,
    timeout: Duration,
) -> Result<(), RankError> {
    ctx.enter(Phase::Prefill);
    let sampler = SamplerConfig {
        temperature: req.temperature,
        top_k: req.top_k,
        top_p: req.top_p,
        seed: req.seed,
    };
    let gen = GenerateOptions {
        max_new_tokens: req.max_new_tokens,
        stop: req.stop.clone(),
    };
    let control = ctx.control.clone();
    let rank = ctx.rank;
    // Tokens so far; whether rank 0 has decided this request's early end.
    let mut n = 0u64;
    let mut decided = false;
    let stats = generate(model, comm, &sampler, &req.prompt, &gen, &mut |id| {
        if n == 0 {
            ctx.enter(Phase::Decode);
        }
        n += 1;
        if rank == 0 {
            control.push_token(id, timeout)?;
            // The coordinator asked for an early end (its client went away, or a stop
            // string ended the text). Every rank must end at the same step, and another may
            // already be up to two tokens ahead of this one (a GPU rank reads token i while
            // step i + 1 runs, and no rank finishes a step before rank 0 has launched it):
            // so all end at n + 3, which none has passed.
            if !decided && control.cancel_requested() == req.id {
                control.set_stop(req.id, n + EARLY_STOP_MARGIN);
                decided = true;
            }
        }
        control.beat(rank);
        Ok(control.stop_for(req.id).is_none_or(|at| n < at))
    })?;
    if rank == 0 {
        report(
            conn,
            &Report::Served {
                id: req.id,
                prompt_tokens: stats.prompt_tokens,
                generated: stats.generated,
                stopped: stats.stopped,
            },
        )?;
    }
    Ok(())
}
