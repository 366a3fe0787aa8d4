//! A `serve` job on one rank: load the shard (with a KV-cache slot per sequence of the
//! batch), join the communicator, then decode the requests the coordinator sends
//! (`Msg::Work`) as a continuous batch until it says stop.
//!
//! Every rank receives the same requests in the same order over its socket, but only rank 0
//! decides when each joins the batch or leaves it early: before every step it publishes the
//! step's plan in the control block (requests admitted, requests evicted, or the end), and
//! every rank reads it before running the step, so all run the same batch with no socket
//! round trip per token. Admitted requests are prefilled one by one into a free slot, then
//! the batch runs one token per sequence per step ([`Model::step_batch`]); a sequence
//! leaves on its stop id or its token budget (every rank sees the same tokens, so all agree
//! without being told). Rank 0 publishes each token, tagged with its request, through the
//! control block's token ring and reports each request's end.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tprun_ipc::control::{describe_abort, PLAN_MAX};
use tprun_ipc::{Conn, IpcError, Msg};
use tprun_kernels::ops::SampleParams;
use tprun_kernels::Device;

use crate::comm::Communicator;
use crate::decode::{report, start};
use crate::job::{self, Backend, GenRequest, Report, ServeSpec, Work};
use crate::model::{BatchRow, BatchStart, GenerateOptions, Model, SamplerConfig};
use crate::run::RankCtx;
use crate::{Phase, RankError};

/// A plan entry `EVICT | id`: request `id` leaves the batch (or the queue) now.
const EVICT: u64 = 1 << 63;
/// A plan entry: every request is done; close and exit.
const SHUTDOWN: u64 = 1 << 62;

/// A request in the batch.
struct Seq {
    req: GenRequest,
    slot: usize,
    params: SampleParams,
    /// Most tokens it may generate (its max_new_tokens, capped by the cache).
    budget: usize,
    /// Tokens generated so far (a stop id is not one).
    generated: usize,
    /// Its last token, which the next step runs.
    last: u32,
}

impl Seq {
    fn row(&self) -> BatchRow {
        BatchRow {
            slot: self.slot,
            token: self.last,
            pos: self.req.prompt.len() + self.generated - 1,
            params: self.params,
        }
    }
}

/// What this rank knows of the work: the batch, and the requests received but not yet
/// admitted (rank 0 also the cancels and whether to shut down).
struct Batch {
    running: Vec<Seq>,
    inbox: VecDeque<GenRequest>,
    cancels: Vec<u64>,
    shutdown: bool,
}

pub fn run<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: Arc<D>,
    backend: Backend,
    spec: &ServeSpec,
    timeout: Duration,
    spin: u32,
) -> Result<(), RankError> {
    let slots = spec.max_batch.max(1);
    let (mut model, mut comm) = start(ctx, conn, dev, backend, &spec.model, slots, timeout, spin)?;
    if ctx.rank == 0 {
        report(conn, &Report::Ready)?;
    }
    let mut b = Batch {
        running: Vec::new(),
        inbox: VecDeque::new(),
        cancels: Vec::new(),
        shutdown: false,
    };
    for step in 1u64.. {
        let plan = if ctx.rank == 0 {
            plan_step(ctx, conn, &mut b, model.slots(), step, timeout)?
        } else {
            wait_plan(ctx, step)?
        };
        let mut admit = Vec::new();
        for e in plan {
            if e == SHUTDOWN {
                comm.close()?;
                return Ok(());
            } else if e & EVICT != 0 {
                evict(ctx, conn, &mut b, e & !EVICT)?;
            } else {
                admit.push(e);
            }
        }
        // New requests are prefilled in the step itself, next to the running sequences'
        // tokens (no stall of the batch for a separate prefill pass), as far as the step's
        // rows allow; a longer prompt (or any in a hybrid model) is prefilled alone first.
        let mut starting: Vec<Seq> = Vec::new();
        // Every admitted request may end up a row of its own (one prefilled alone joins the
        // running ones): count them all against the step's rows.
        let rows_bound = b.running.len() + admit.len();
        for id in admit {
            let req = take_request(ctx, conn, &mut b, id)?;
            let seq = match seat(&model, &b, &starting, req) {
                Ok(seq) => seq,
                Err(req) => {
                    served(ctx, conn, &req, 0, false)?;
                    continue;
                }
            };
            let tokens = starting.iter().map(|s| s.req.prompt.len()).sum::<usize>();
            if model.batch_room(rows_bound, tokens + seq.req.prompt.len()) {
                starting.push(seq);
            } else {
                start_alone(ctx, conn, &mut model, &mut comm, &mut b, seq, timeout)?;
            }
        }
        if b.running.is_empty() && starting.is_empty() {
            if ctx.rank == 0 {
                // (first tokens that ended their requests)
                ctx.control.record_batch(0, 0);
            }
            continue;
        }
        ctx.enter(if starting.is_empty() {
            Phase::Decode
        } else {
            Phase::Prefill
        });
        let rows: Vec<BatchRow> = b.running.iter().map(Seq::row).collect();
        let starts: Vec<BatchStart> = starting
            .iter()
            .map(|s| BatchStart {
                slot: s.slot,
                prompt: &s.req.prompt,
                params: s.params,
            })
            .collect();
        let tokens = model.step_batch(&mut comm, &rows, &starts)?;
        let stepped = rows.len() + starts.len();
        if ctx.rank == 0 {
            // Whoever sees a token sees the step that made it counted, and its batch.
            ctx.control.record_batch(stepped, stepped);
        }
        let (mut i, mut done) = (0, Vec::new());
        for &t in &tokens[..rows.len()] {
            match take(ctx, &mut b.running[i], t, timeout)? {
                None => i += 1,
                Some(stopped) => done.push((b.running.remove(i), stopped)),
            }
        }
        for (mut s, &t) in starting.into_iter().zip(&tokens[rows.len()..]) {
            s.last = t;
            match take(ctx, &mut s, t, timeout)? {
                None => b.running.push(s),
                Some(stopped) => done.push((s, stopped)),
            }
        }
        // The statistics first: whoever hears of an end sees the batch without it.
        if ctx.rank == 0 {
            ctx.control.record_batch(0, b.running.len());
        }
        for (s, stopped) in done {
            served(ctx, conn, &s.req, s.generated, stopped)?;
        }
        ctx.control.beat(ctx.rank);
    }
    unreachable!("the steps are counted by a u64")
}

/// Rank 0: takes in the work the coordinator has sent (waiting for some when there is
/// nothing to do), decides this step's admissions, evictions or end, and publishes them once
/// every rank has read the previous step's plan.
fn plan_step(
    ctx: &RankCtx,
    conn: &Conn,
    b: &mut Batch,
    slots: usize,
    step: u64,
    timeout: Duration,
) -> Result<Vec<u64>, RankError> {
    let mut block = b.running.is_empty() && b.inbox.is_empty() && !b.shutdown;
    if block {
        ctx.enter(Phase::Idle);
    }
    loop {
        let wait = if block { None } else { Some(Duration::ZERO) };
        let msg = match wait {
            None => ctx.beating(|| next_work(ctx, conn, None))?,
            Some(_) => next_work(ctx, conn, wait)?,
        };
        match msg {
            None => break,
            Some(Work::Generate(req)) => b.inbox.push_back(req),
            Some(Work::Cancel(id)) => b.cancels.push(id),
            Some(Work::Shutdown) => b.shutdown = true,
        }
        block = false;
    }
    let mut plan = Vec::new();
    // Cancels of requests still here (a finished one's cancel comes too late: dropped),
    // as many as the plan holds next to a full batch of admissions.
    let known =
        |id: &u64| b.running.iter().any(|s| s.req.id == *id) || b.inbox.iter().any(|r| r.id == *id);
    let mut later = Vec::new();
    for id in std::mem::take(&mut b.cancels) {
        if !known(&id) || plan.contains(&(EVICT | id)) {
            continue;
        }
        if plan.len() < PLAN_MAX - slots - 1 {
            plan.push(EVICT | id);
        } else {
            later.push(id);
        }
    }
    b.cancels = later;
    let evicted = |id: u64| plan.contains(&(EVICT | id));
    let staying = b.running.iter().filter(|s| !evicted(s.req.id)).count();
    let admits: Vec<u64> = b
        .inbox
        .iter()
        .map(|r| r.id)
        .filter(|&id| !evicted(id))
        .take(slots - staying)
        .collect();
    let waiting = b.inbox.iter().filter(|r| !evicted(r.id)).count();
    if b.shutdown && staying == 0 && waiting == 0 {
        plan.push(SHUTDOWN);
    }
    plan.extend(admits);
    // One plan at a time: every rank must have read the last before it is overwritten.
    ctx.control.publish_plan_when_read(step, &plan, timeout)?;
    Ok(plan)
}

/// Every rank but 0: waits for rank 0's plan of step `step` (as long as the server is idle;
/// an abort ends the wait).
fn wait_plan(ctx: &RankCtx, step: u64) -> Result<Vec<u64>, RankError> {
    Ok(ctx
        .control
        .wait_plan(ctx.rank, step, || ctx.enter(Phase::Idle))?)
}

/// The coordinator's next `Msg::Work`, waiting at most `wait` (`None`: until it comes). The
/// coordinator hangs up on an aborted job: that is then the abort (another rank failed
/// first), not a failure of ours.
fn next_work(
    ctx: &RankCtx,
    conn: &Conn,
    wait: Option<Duration>,
) -> Result<Option<Work>, RankError> {
    let msg = match conn.recv(wait) {
        Ok((m, _)) => m,
        Err(IpcError::Timeout(_)) if wait.is_some() => return Ok(None),
        Err(e) => {
            return Err(match ctx.control.aborted() {
                Some((reason, who)) => IpcError::Aborted(describe_abort(reason, who)),
                None => e,
            }
            .into())
        }
    };
    match msg {
        Msg::Work { payload } => Ok(Some(job::decode(&payload)?)),
        other => Err(RankError::Other(format!(
            "expected work from the coordinator, got {other:?}"
        ))),
    }
}

/// Request `id` from the inbox; a rank other than 0 may not have received it yet (rank 0 saw
/// it first): it reads its socket until it has.
fn take_request(
    ctx: &RankCtx,
    conn: &Conn,
    b: &mut Batch,
    id: u64,
) -> Result<GenRequest, RankError> {
    loop {
        if let Some(i) = b.inbox.iter().position(|r| r.id == id) {
            return Ok(b.inbox.remove(i).expect("found above"));
        }
        if ctx.rank == 0 {
            return Err(RankError::Other(format!(
                "request {id} is not in the inbox"
            )));
        }
        // Only requests come to the others (cancels and the shutdown reach them as rank 0's
        // plans).
        if let Some(Work::Generate(req)) = next_work(ctx, conn, None)? {
            b.inbox.push_back(req);
        }
    }
}

/// Ends request `id` early: out of the batch (its slot is free) or out of the inbox.
fn evict(ctx: &RankCtx, conn: &Conn, b: &mut Batch, id: u64) -> Result<(), RankError> {
    if let Some(i) = b.running.iter().position(|s| s.req.id == id) {
        let s = b.running.remove(i);
        if ctx.rank == 0 {
            ctx.control.record_batch(0, b.running.len());
        }
        return served(ctx, conn, &s.req, s.generated, true);
    }
    let req = take_request(ctx, conn, b, id)?;
    served(ctx, conn, &req, 0, true)
}

/// `req`'s place in the batch: the first slot neither running nor `starting` holds, its
/// sampler and its token budget; the request back when its budget is 0 (it is done).
fn seat<D: Device>(
    model: &Model<D>,
    b: &Batch,
    starting: &[Seq],
    req: GenRequest,
) -> Result<Seq, GenRequest> {
    let budget = GenerateOptions {
        max_new_tokens: req.max_new_tokens,
        stop: Vec::new(),
    }
    .budget(model.max_seq(), req.prompt.len());
    if budget == 0 {
        return Err(req);
    }
    let taken = |s: usize| b.running.iter().chain(starting).any(|q| q.slot == s);
    let slot = (0..model.slots())
        .find(|&s| !taken(s))
        .expect("rank 0 admits no more requests than there are slots");
    let params = SamplerConfig {
        temperature: req.temperature,
        top_k: req.top_k,
        top_p: req.top_p,
        seed: req.seed,
    }
    .params();
    Ok(Seq {
        req,
        slot,
        params,
        budget,
        generated: 0,
        last: 0,
    })
}

/// Prefills `s` alone into its slot and takes its first token; it joins the batch unless that
/// token already ends it.
fn start_alone<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    model: &mut Model<D>,
    comm: &mut Communicator<D>,
    b: &mut Batch,
    mut s: Seq,
    timeout: Duration,
) -> Result<(), RankError> {
    ctx.enter(Phase::Prefill);
    let first = model.begin_in(comm, s.slot, &s.req.prompt, &s.params)?;
    s.last = first;
    if ctx.rank == 0 {
        // Whoever sees its first token sees it in the batch.
        ctx.control.record_batch(0, b.running.len() + 1);
    }
    match take(ctx, &mut s, first, timeout)? {
        None => b.running.push(s),
        Some(stopped) => served(ctx, conn, &s.req, s.generated, stopped)?,
    }
    Ok(())
}

/// Takes token `t` of `s`: `Some(stopped)` when it ends the request (a stop id, not
/// published, or the last of its budget), else `None`. Rank 0 publishes it.
fn take(ctx: &RankCtx, s: &mut Seq, t: u32, timeout: Duration) -> Result<Option<bool>, RankError> {
    if s.req.stop.contains(&t) {
        return Ok(Some(true));
    }
    if ctx.rank == 0 {
        // The tag is the id's low half: unique among requests in flight.
        ctx.control.push_token(s.req.id as u32, t, timeout)?;
    }
    s.generated += 1;
    s.last = t;
    Ok((s.generated >= s.budget).then_some(false))
}

/// Rank 0 reports the end of `req` (its tokens are in the ring already).
fn served(
    ctx: &RankCtx,
    conn: &Conn,
    req: &GenRequest,
    generated: usize,
    stopped: bool,
) -> Result<(), RankError> {
    if ctx.rank != 0 {
        return Ok(());
    }
    report(
        conn,
        &Report::Served {
            id: req.id,
            prompt_tokens: req.prompt.len(),
            generated,
            stopped,
        },
    )
}
